"""What a part of the GPU check writes, and the time it has.

A part runs in a process of its own with a deadline (its share of the check's budget). Each of its
steps is one call of `Context.step`: the step is skipped with a line when too little of the share is
left for it, otherwise it runs and its values are written at once as one JSON line of
DIR/logs/<part>.jsonl — so a part stopped at its deadline keeps everything it measured before. A
step that raises `Skip` is a skip line with its reason; any other exception is an error line (the
traceback goes to the part's log). Values with a "passed" key are checks.

The helpers below measure, never assert: peak memory (GPU: the allocator's peak; CPU: the process's
peak resident memory, reset before the step) and relative logit gaps.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch


class Skip(Exception):
    """Raised by a step that cannot run here; its message is the skip line's reason."""


@dataclass
class Context:
    """A running part: where it writes, whether this is the dry run, the device and its deadline."""
    part: str
    out: Path          # the check's output folder (results and logs)
    scratch: Path      # large files shared by the parts (models, checkpoints); removed at the end
    dry: bool
    device: str
    deadline: float    # time.time() at which the part is stopped
    log: Path = field(init=False)

    def __post_init__(self):
        self.log = self.out / "logs" / f"{self.part}.jsonl"

    def left(self) -> float:
        return self.deadline - time.time()

    def size(self, gpu, dry):
        """The GPU run's value, or the dry run's toy one."""
        return dry if self.dry else gpu

    def write(self, **record) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def skip(self, step: str, reason: str) -> None:
        self.write(kind="skip", step=step, reason=reason)
        print(f"[{self.part}] {step}: skipped: {reason}", flush=True)

    def step(self, name: str, fn, *, needs: float = 0.0):
        """Run fn() → dict of values as the step `name`, or skip it when less than `needs` seconds are left."""
        left = self.left()
        if left < needs:
            self.skip(name, f"the part's share is spent ({left:.0f} s left, the step needs about {needs:.0f} s)")
            return None
        self.write(kind="start", step=name, at=time.time())
        print(f"[{self.part}] {name} …", flush=True)
        start = time.perf_counter()
        try:
            values = fn()
        except Skip as e:
            self.skip(name, str(e))
            return None
        except Exception as e:  # a failed step is a result too: recorded, and the part goes on
            traceback.print_exc()
            self.write(kind="error", step=name, error=one_line(e), seconds=time.perf_counter() - start)
            return None
        kind = "check" if "passed" in values else "row"
        self.write(kind=kind, step=name, values=values, seconds=time.perf_counter() - start)
        print(f"[{self.part}] {name}: {json.dumps(values, default=str)}", flush=True)
        return values


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


# ---- measuring ------------------------------------------------------------------------------------

def reset_peaks(device: str) -> None:
    """Restart the peak counts of the GPU allocator (on CUDA) and of this process's resident memory."""
    from mha2mla.evaluate.speed import reset_peak

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak()


def peaks(device: str) -> dict:
    """{"peak_gpu_mb" (CUDA only), "peak_rss_mb"} since reset_peaks."""
    from mha2mla.evaluate.speed import peak_mb

    values = {"peak_rss_mb": round(peak_mb(), 1)}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        values["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return values


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> int:
    """Bytes a new allocation can take on `device` (the GPU's free memory, or the host's available)."""
    from mha2mla.evaluate.speed import available_bytes

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return available_bytes()


def release(device: str) -> None:
    """Give cached GPU memory back between steps, so one step's peak is not the next one's floor."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
