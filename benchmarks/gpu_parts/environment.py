"""Part 1 of the GPU check: the machine, the package versions, and which attention kernels load.

Rows: the device (name, memory, multiprocessors, compute capability, CUDA and driver versions; the
CPU in the dry run), the versions of the packages the check and mha2mla use (or "missing"), each
attention implementation an MLA model can be set to (eager, sdpa, flash_attention_2, …) loaded and
run for one bf16 forward on the device, and on CUDA each of torch's SDPA backends (flash, memory
efficient, cuDNN, math) forced on one bf16 call of the MLA expanded path's shape.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform

import torch

from .record import Context, Skip

PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "gguf", "triton", "flash_attn",
            "vllm", "lm_eval", "datasets")
IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def run(ctx: Context) -> None:
    ctx.step("device", lambda: device_row(ctx.device))
    ctx.step("packages", package_versions)
    ctx.step("mha2mla imports", mha2mla_imports)
    for implementation in IMPLEMENTATIONS:
        ctx.step(f"attention implementation {implementation}", lambda i=implementation: try_implementation(ctx, i))
    ctx.step("SDPA backends (bf16)", lambda: sdpa_backends(ctx.device))


def device_row(device: str) -> dict:
    row = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
           "cpu_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if not device.startswith("cuda"):
        return {**row, "device": f"cpu ({platform.processor() or platform.machine()})"}
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU")
    p = torch.cuda.get_device_properties(0)
    return {**row, "device": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
            "driver": driver_version()}


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # the driver version is a nicety; its absence is no failure
        return None


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing" if importlib.util.find_spec(name) is None else "present (no metadata)"
    return versions


def mha2mla_imports() -> dict:
    """Whether the modules the check drives import here (a missing gguf stops the I/O layer)."""
    modules = ("mha2mla.modeling", "mha2mla.io.sources", "mha2mla.conversion.pipeline", "mha2mla.exports",
               "mha2mla.evaluate.speed", "mha2mla.apps.train", "mha2mla.apps.demo")
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(modules)} modules fail: {failed}")
    return {"modules": len(modules), "all_import": True}


def tiny_mla():
    from mha2mla import MLAConfig, MLAForCausalLM

    config = MLAConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, d_kv=16, rope_pairs=4)
    return MLAForCausalLM(config).eval()


@torch.no_grad()
def try_implementation(ctx: Context, implementation: str) -> dict:
    """Set a tiny MLA model to `implementation` and run one bf16 forward on the device."""
    model = tiny_mla().to(ctx.device, torch.bfloat16)
    try:
        model.set_attn_implementation(implementation)
        logits = model(torch.randint(0, 64, (2, 16), device=ctx.device)).logits
    except Exception as e:  # not loading is the measurement here
        return {"loads": False, "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {"loads": True, "finite": bool(torch.isfinite(logits).all())}


def sdpa_backends(device: str) -> dict:
    """Which of torch's fused SDPA kernels run a bf16 call shaped like the MLA expanded path's."""
    if not device.startswith("cuda"):
        raise Skip("SDPA kernel selection is CUDA's (on the CPU the math and flash-CPU kernels run)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 8, 256, 80, device=device, dtype=torch.bfloat16) for _ in range(3))
    works = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            works[backend.name.lower()] = True
        except Exception as e:  # a backend that refuses the shape or the card is the measurement
            works[backend.name.lower()] = f"no: {str(e).splitlines()[0][:120]}"
    return works
