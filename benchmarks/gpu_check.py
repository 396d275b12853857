"""One call on a GPU machine: every GPU path of mha2mla checked and measured within a hard time budget.

    python benchmarks/gpu_check.py --out DIR [--budget-s 510] [--parts a,b] [--device cuda]
    python benchmarks/gpu_check.py --out DIR --dry-run     # every part on the CPU at toy sizes
    python benchmarks/gpu_check.py --bundle                # here, before a call: .gpu/ (docs/gpu.md)

Parts (benchmarks/gpu_parts/, in this order): environment (device, versions, attention kernels),
exactness (full-rank conversion, absorbed = expanded, cached = full forward, eager = sdpa = flash; fp32
and bf16), conversion (SmolLM2-135M at 72 values and its perplexity against the CPU figure; a random
Llama-2-7B-shaped bf16 checkpoint converted on the device), decode (source vs MLA, 4K/16K × batch 1/32),
training (20 bf16 steps, source vs MLA vs MLA distilled), serving (DeepSeek-V3 export in transformers;
vLLM with TRITON_MLA when installed) and the demo with the time that remains.

Budget. Each part runs in a process of its own (its own process group) with a share of the time left:
its weight (gpu_parts.PARTS) over the weights of the parts still to run, so time one part leaves over
goes to the next. A step starts only when the share has the time it needs (else a skip line); at the
end of its share the part's processes are killed and its running step is marked stopped. The whole run
ends within --budget-s of its start. Parts start as fresh interpreters (spawn) by default; the dry run
forks them from a parent that imported torch once (`--start fork`), which never touches CUDA.

Output: DIR/results.md (one line per step: measured, passed/FAILED, skipped, error or stopped, with
its values), DIR/results.json (the same as data), DIR/logs/<part>.log (the part's raw output) and
DIR/logs/<part>.jsonl (its records); the demo's figure and report in DIR/demo/. Exit status 1 when a
check failed or a step raised, else 0. Nothing is asserted about speed: every figure is measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUNDLE_BASE = REPO / ".gpu" / "base"
RESERVE_S = 2.0      # kept back from the budget to write the results
MIN_SHARE_S = {"gpu": 10.0, "dry": 1.0}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="output folder (results.md, results.json, logs/)")
    p.add_argument("--budget-s", type=float, default=510.0, help="hard limit on the whole run (default 510 s)")
    p.add_argument("--dry-run", action="store_true", help="every part on the CPU at toy sizes")
    p.add_argument("--parts", default=None, help="comma-separated subset of the parts (default: all)")
    p.add_argument("--device", default="cuda", help="the device of the GPU run (default cuda)")
    p.add_argument("--start", choices=("fork", "spawn"), default=None,
                   help="how parts start (default: spawn; fork in the dry run)")
    p.add_argument("--scratch", type=Path, default=None, help="where large temporary files go (default: $TMPDIR)")
    p.add_argument("--bundle", action="store_true", help="write .gpu/, what the GPU machine lacks (docs/gpu.md)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)       # internal: run one part (spawn)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.bundle or args.out):
        p.error("--out DIR is required")
    return args


def prepare_environment() -> None:
    """Make src/ and the bundle (gguf, offline text) importable and found, here and in every child."""
    paths = [str(REPO / "src")] + ([str(BUNDLE_BASE / "site")] if (BUNDLE_BASE / "site").is_dir() else [])
    sys.path[:0] = [p for p in paths if p not in sys.path]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    if ("MHA2MLA_DATA_DIR" not in os.environ and not (REPO.parent / "shared" / "data").is_dir()
            and (BUNDLE_BASE / "data").is_dir()):
        os.environ["MHA2MLA_DATA_DIR"] = str(BUNDLE_BASE / "data")
    for name, value in (("TOKENIZERS_PARALLELISM", "false"), ("PYTHONUNBUFFERED", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_HUB_DISABLE_TELEMETRY", "1"), ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")):
        os.environ.setdefault(name, value)


def preload(names: list[str]) -> None:
    """Import the parts (torch, transformers, mha2mla with them) once, for forked parts; a failure is the
    part's own to report, in its process."""
    for name in names:
        try:
            importlib.import_module(f"gpu_parts.{name}")
        except Exception:  # the part's own process hits the same error and records it
            pass


# ---- one part -------------------------------------------------------------------------------------

def run_part(name: str, out: Path, scratch: Path, deadline: float, device: str, dry: bool) -> int:
    """The body of a part's process: run gpu_parts.<name>.run(ctx) → exit status."""
    from gpu_parts.record import Context, one_line

    ctx = Context(name, out, scratch, dry, device, deadline)
    try:
        importlib.import_module(f"gpu_parts.{name}").run(ctx)
    except Exception as e:  # an import or setup failure of the whole part: one error line
        traceback.print_exc()
        ctx.write(kind="error", step="(part)", error=one_line(e))
        return 1
    return 0


def start_part(args, name: str, share: float, scratch: Path, log) -> int:
    """Start a part's process in a process group of its own → its pid."""
    deadline, device = time.time() + share, "cpu" if args.dry_run else args.device
    if start_mode(args) == "spawn":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(args.out),
               "--scratch", str(scratch), "--deadline", str(deadline), "--device", device]
        return subprocess.Popen(cmd + (["--dry-run"] if args.dry_run else []), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True).pid
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the part: whatever happens, this process ends here and never returns into the loop
        code = 1
        try:
            os.setsid()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            code = run_part(name, args.out, scratch, deadline, device, args.dry_run)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    return pid


def wait_part(pid: int, share: float) -> str:
    """Wait for the part until its share ends, then kill its process group → how it ended."""
    end = time.time() + share
    try:
        while time.time() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return "finished" if code == 0 else f"exited with status {code}"
            time.sleep(0.1)
        return f"stopped at the end of its share ({share:.0f} s)"
    finally:
        kill_group(pid)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def start_mode(args) -> str:
    return args.start or ("fork" if args.dry_run else "spawn")


# ---- the whole run --------------------------------------------------------------------------------

def selected_parts(args) -> list[tuple[str, float]]:
    from gpu_parts import PARTS

    if not args.parts:
        return list(PARTS)
    wanted = args.parts.split(",")
    unknown = set(wanted) - {name for name, _ in PARTS}
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose among {', '.join(n for n, _ in PARTS)}")
    return [(name, w) for name, w in PARTS if name in wanted]


def run_parts(args, t0: float, scratch: Path, results: list[dict]) -> None:
    """Run the parts in order, appending each one's record to `results` as it starts (so a run stopped from
    outside still reports the parts before, and the one it stopped)."""
    from gpu_parts.report import read_steps

    parts = selected_parts(args)
    for i, (name, weight) in enumerate(parts):
        left = t0 + args.budget_s - RESERVE_S - time.time()
        share = left * weight / sum(w for _, w in parts[i:])
        record = {"name": name, "share_s": share, "seconds": 0.0, "steps": [],
                  "outcome": "interrupted: the check was stopped from outside"}
        results.append(record)
        if share < MIN_SHARE_S["dry" if args.dry_run else "gpu"]:
            record.update(share_s=None, outcome=f"not started: {max(left, 0):.0f} s of the budget left")
            continue
        started = time.time()
        try:
            with open(args.out / "logs" / f"{name}.log", "w") as log:
                record["outcome"] = wait_part(start_part(args, name, share, scratch, log), share)
        finally:
            record["seconds"] = time.time() - started
            record["steps"] = read_steps(args.out / "logs" / f"{name}.jsonl", record["outcome"])
        print(f"[{time.time() - t0:5.0f} s] {name}: {record['outcome']} ({record['seconds']:.0f} of "
              f"{share:.0f} s), {len(record['steps'])} lines", flush=True)


def clean_out(out: Path) -> None:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for old in [*(out / "logs").iterdir(), out / "results.md", out / "results.json"]:
        old.unlink(missing_ok=True)
    shutil.rmtree(out / "demo", ignore_errors=True)


def check(args, t0: float) -> int:
    from gpu_parts.report import write_results

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still kill the part and write results
    clean_out(args.out)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.scratch))
    parts = []
    try:
        if start_mode(args) == "fork":
            preload([name for name, _ in selected_parts(args)])
        run_parts(args, t0, scratch, parts)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        done = {part["name"] for part in parts}
        parts += [{"name": name, "share_s": None, "seconds": 0.0, "steps": [],
                   "outcome": "not run: the check ended first"} for name, _ in selected_parts(args) if name not in done]
        meta = {"mode": "dry run (toy sizes on the CPU)" if args.dry_run else f"GPU run on {args.device}",
                "budget_s": args.budget_s, "used_s": round(time.time() - t0, 1), "parts start by": start_mode(args),
                "command": " ".join([Path(sys.executable).name, *sys.argv])}
        counts = write_results(args.out, meta, parts)
    print(f"{args.out / 'results.md'}: {json.dumps(counts)}")
    return 1 if counts.get("FAILED") or counts.get("error") else 0


def main(argv=None) -> int:
    t0 = time.time()
    args = parse(argv)
    prepare_environment()
    if args.bundle:
        from gpu_parts.bundle import make_bundle

        make_bundle()
        return 0
    if args.part:
        return run_part(args.part, args.out, args.scratch, args.deadline, args.device, args.dry_run)
    return check(args, t0)


if __name__ == "__main__":
    sys.exit(main())
