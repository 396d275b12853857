"""Fine-tuning recipe: MHA2MLA's recovery training on packed text, on transformers' Trainer.

The same recipe trains source (MHA/GQA) and converted MLA models, on one CPU/GPU or unchanged under
`accelerate launch` / `torchrun` (Trainer reads the distributed environment; DDP, FSDP and DeepSpeed
come from accelerate's config, see docs/training.md).

Recipe (the paper's defaults): AdamW with β = (0.9, 0.95), ε = 1e-8, weight decay 0, peak learning
rate 1e-4, gradients clipped to norm 1.0, and a warmup–stable–decay schedule with 1-sqrt decay.
For S optimizer steps, W = ceil(0.05·S) warmup steps and D = floor(0.1·S) decay steps, the rate
used at step s (0-based) is

    lr(s) = lr · s / W                          s < W            linear warmup
    lr(s) = lr                                  W ≤ s < S − D    stable
    lr(s) = lr · (1 − sqrt((s − S + D) / D))    S − D ≤ s < S    1-sqrt decay

(transformers' get_wsd_schedule). Text is packed into fixed blocks of `seq_len` tokens (documents
joined by EOS); exactly steps · batch · grad_accum · processes blocks are drawn and shuffled with
the run's seed, so every run with the same settings sees the same data in the same order.

With `distill` (apps/distill.py) the loss is distillation from a frozen teacher (by default the source
the MLA model was converted from), or from its top-k targets written beforehand (apps/distill_targets.py),
mixed with the LM loss; the loss log's `loss` is then still the LM loss, comparable across runs, beside
the KL and the objective.

The output folder:
    run.json          model, panel ("MHA2MLA"/"GQA2MLA"), variant ("base"/"d_kv=16"), settings,
                      and once the final model is written: "finished" and the result
    loss.jsonl        one line per optimizer step: step, loss (LM), lr, tokens (seen so far), grad_norm;
                      distilled: kl and objective too
    checkpoints/      the last two complete checkpoints (Trainer's format: weights, optimizer,
                      schedule, RNG, data position). Trainer writes each into checkpoints/.staging; it
                      is renamed into place only after every process has finished, so a kill never
                      leaves a partial one. Removed when the run finishes.
    config.json, model.safetensors, tokenizer files    the final model
`resume=True` reloads the last checkpoint and drops loss lines past it: the log then has no lost
and no repeated step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from ..errors import UserError
from ..io.atomic import write_file_atomically
from ..io.checkpoint import write_checkpoint_files
from ..io.sources import load_model
from ..io.text import default_train_text, pack_blocks
from .distill import Distillation, DistillationTrainer, load_teacher
from .distill_targets import Targets

WARMUP_FRACTION = 0.05
DECAY_FRACTION = 0.10
# Settings that fix the trajectory: a resumed run must repeat them.
TRAJECTORY = ("steps", "seq_len", "batch_size", "grad_accum", "lr", "freeze_non_attention", "bf16", "seed",
              "data", "processes", "distill")


# ---- the entry point ----------------------------------------------------------------------------

def train(model_or_path, out, data=None, steps: int = 100, *, seq_len: int = 512, batch_size: int = 4,
          grad_accum: int = 1, lr: float = 1e-4, freeze_non_attention: bool = False, bf16: bool = False,
          resume: bool = False, save_every: int = 100, seed: int = 0, distill: Distillation | None = None,
          panel: str | None = None, variant: str | None = None, callbacks: list | None = None) -> dict:
    """Fine-tune a model (path/alias or a (model, tokenizer) tuple) into `out`; returns the result.

    `data`: text files/directories (default: the Wikipedia shards). `panel`/`variant` label the run
    for the figure (default: read from the model). With `resume`, a run already in `out` continues
    from its last checkpoint (a finished run is returned as it is); without it `out` must be empty.
    The model object of a tuple is trained in place; `callbacks`: extra TrainerCallbacks (e.g. an
    evaluation during the run). `distill`: a Distillation (teacher or offline targets, α, T). Result: {"out", "steps",
    "final_loss" (LM), "tokens", "seconds", "panel", "variant", "peak_rss_mb", "teacher_bytes"}.
    """
    _check_numbers(steps, batch_size, grad_accum, lr, save_every)
    if distill is not None:
        distill.check()
    out = Path(out)
    if not resume and out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty (pass --resume to continue the run there, or choose a new directory)")
    model, tokenizer, name = _load(model_or_path)
    data = [str(Path(p).resolve()) for p in (data or [default_train_text()])]
    args = training_arguments(out, steps, seq_len, batch_size, grad_accum, lr, bf16, save_every, seed)
    settings = dict(steps=steps, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                    freeze_non_attention=freeze_non_attention, bf16=bf16, seed=seed, data=data,
                    processes=args.world_size, distill=distill_record(distill))
    panel_, variant_ = run_label(model.config)
    record = {"model": name, "signature": weights_signature(model), "panel": panel or panel_,
              "variant": variant or variant_, "settings": settings}
    previous = check_resumable(out, record) if resume else None
    if previous and previous.get("finished"):
        return previous["result"]

    blocks = pack_blocks(tokenizer, data, seq_len, steps * batch_size * grad_accum * args.world_size,
                         what="training text")
    if freeze_non_attention:
        freeze_all_but_attention(model)
    checkpoint = prepare_out(out, record, resume, args.process_index == 0)

    use_cache = model.config.use_cache
    log = LossLog(out / "loss.jsonl")
    targets = Targets(distill.targets, blocks, model.config.vocab_size) if distill and distill.targets else None
    teacher = load_teacher(distill, model, tokenizer) if distill and not targets else None
    extra = dict(teacher=teacher, targets=targets, distillation=distill) if distill else {}
    trainer = (DistillationTrainer if distill else Trainer)(
        model=model, args=args, train_dataset=Blocks(blocks, indexed=targets is not None), **extra,
        callbacks=[log, AtomicCheckpoints(out / "checkpoints"), *tensorboard(out, args), *(callbacks or [])])
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(ProgressBar())
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if log.bad_loss is not None:
        kept = drop_checkpoint_before(out / "checkpoints", log.bad_step, args.process_index == 0)
        raise UserError(f"loss became {log.bad_loss} at step {log.bad_step}: training stopped; "
                        + (f"the last good checkpoint is kept in {kept}" if kept else "no good checkpoint was written")
                        + " (start a new run with a lower --lr)")

    result = {"out": str(out), "steps": steps, "final_loss": log.last_loss,
              "tokens": trainer.state.num_input_tokens_seen, "seconds": time.perf_counter() - start,
              "panel": record["panel"], "variant": record["variant"],
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "teacher_bytes": sum(p.numel() * p.element_size() for p in teacher.parameters()) if teacher else 0}
    model.config.use_cache = use_cache  # Trainer turns the KV cache off for training
    save_final(trainer, tokenizer, out, {**record, "finished": True, "result": result})
    return result


def distill_record(distill: Distillation | None) -> dict | None:
    """The distillation settings as run.json keeps them (a loaded teacher by its name)."""
    if distill is None:
        return None
    teacher = distill.teacher
    name = teacher if teacher is None or isinstance(teacher, str) else teacher.config._name_or_path
    return {**dataclasses.asdict(distill), "teacher": name}


def _check_numbers(steps, batch_size, grad_accum, lr, save_every) -> None:
    if steps <= 0:
        raise UserError(f"--steps must be positive (got {steps})")
    if batch_size <= 0 or grad_accum <= 0:
        raise UserError(f"--batch-size and --grad-accum must be positive (got {batch_size}, {grad_accum})")
    if not lr > 0:
        raise UserError(f"--lr must be positive (got {lr})")
    if save_every < 0:
        raise UserError(f"--save-every must be 0 (no intermediate checkpoints) or positive (got {save_every})")


def _load(model_or_path):
    """(model, tokenizer, name) from a path/alias or a (model, tokenizer) tuple."""
    if isinstance(model_or_path, (str, os.PathLike)):
        model, tokenizer = load_model(model_or_path)
        path = Path(model_or_path)
        return model, tokenizer, str(path.resolve()) if path.exists() else str(model_or_path)
    model, tokenizer = model_or_path
    return model, tokenizer, model.config._name_or_path or getattr(model.config, "source_model", "")


def training_arguments(out: Path, steps, seq_len, batch_size, grad_accum, lr, bf16, save_every, seed):
    """The recipe as TrainingArguments; Trainer writes checkpoints into out/checkpoints/.staging."""
    return TrainingArguments(
        output_dir=str(out / "checkpoints" / ".staging"), max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
        lr_scheduler_type="warmup_stable_decay", warmup_steps=WARMUP_FRACTION,
        lr_scheduler_kwargs={"num_decay_steps": int(DECAY_FRACTION * steps), "decay_type": "1-sqrt"},
        bf16=bf16, seed=seed, logging_steps=1, logging_nan_inf_filter=False, include_num_input_tokens_seen="all",
        save_strategy="steps" if save_every else "no", save_steps=save_every or 1, report_to="none",
        remove_unused_columns=False, ddp_find_unused_parameters=False, dataloader_num_workers=0,
        # without an accelerator, use_cpu makes torchrun/accelerate launch run CPU DDP over gloo
        use_cpu=not torch.accelerator.is_available(), dataloader_pin_memory=torch.accelerator.is_available())


class Blocks(torch.utils.data.Dataset):
    """Packed token blocks as causal-LM examples (the model shifts the labels); `indexed`: each with its
    index as `block` (where offline distillation targets are read by it)."""

    def __init__(self, blocks: torch.Tensor, indexed: bool = False):
        self.blocks, self.indexed = blocks, indexed

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        example = {"input_ids": self.blocks[i], "labels": self.blocks[i]}
        return {**example, "block": i} if self.indexed else example


def freeze_all_but_attention(model) -> None:
    """Train only the attention projections (names containing `.self_attn.`)."""
    for name, p in model.named_parameters():
        p.requires_grad_(".self_attn." in name)


# ---- run identity and labels --------------------------------------------------------------------

def run_label(config) -> tuple[str, str]:
    """(panel, variant): MHA2MLA for an MHA model, GQA2MLA for a GQA one; "base" or "d_kv=N"."""
    panel = "MHA2MLA" if config.num_key_value_heads == config.num_attention_heads else "GQA2MLA"
    variant = f"d_kv={config.d_kv}" if config.model_type == "mla" else "base"
    return panel, variant


def weights_signature(model) -> str:
    """A short hash of the model type and every parameter's name and shape."""
    text = model.config.model_type + ";" + ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_run(out: Path) -> dict | None:
    path = Path(out) / "run.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_resumable(out: Path, record: dict) -> dict | None:
    """The run already in `out` (None if none); a UserError if it is another model or other settings."""
    previous = read_run(out)
    if previous is None:
        if out.exists() and any(p.name not in ("loss.jsonl", "checkpoints") for p in out.iterdir()):
            raise UserError(f"{out} holds something other than a training run; choose a new directory")
        return None
    if (previous["model"], previous["signature"]) != (record["model"], record["signature"]):
        raise UserError(f"cannot resume: {out} is a run of {previous['model']} ({previous['signature']}), "
                        f"not of {record['model']} ({record['signature']}); choose a new directory")
    changed = [k for k in TRAJECTORY if previous["settings"].get(k) != record["settings"][k]]
    if changed:
        k = changed[0]
        raise UserError(f"cannot resume: the run in {out} used {k}={previous['settings'].get(k)!r}, not "
                        f"{record['settings'][k]!r}; resume with the same settings or choose a new directory")
    return previous


def write_run_record(out: Path, record: dict) -> None:
    write_file_atomically(out / "run.json", lambda f: f.write(json.dumps(record, indent=1) + "\n"))


# ---- output folder, checkpoints, loss log -------------------------------------------------------

def checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in `folder`, oldest first."""
    return sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])) if folder.is_dir() else []


def last_checkpoint(folder: Path) -> Path | None:
    found = checkpoints(folder)
    return found[-1] if found else None


def prepare_out(out: Path, record: dict, resume: bool, is_main: bool) -> Path | None:
    """Write run.json, clear a half-written checkpoint, cut the loss log back to the checkpoint."""
    checkpoint = last_checkpoint(out / "checkpoints") if resume else None
    if is_main:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / "checkpoints" / ".staging", ignore_errors=True)
        write_run_record(out, record)
        done = int(checkpoint.name.split("-")[1]) if checkpoint else 0
        kept = logged_steps(out / "loss.jsonl", done)
        write_file_atomically(out / "loss.jsonl", lambda f: f.writelines(line + "\n" for line in kept))
    PartialState().wait_for_everyone()
    return checkpoint


def logged_steps(path: Path, up_to: int) -> list[str]:
    """The complete loss lines of steps 1 … up_to (a line cut by a kill is dropped)."""
    lines = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            if json.loads(line)["step"] <= up_to:
                lines.append(line)
        except (ValueError, KeyError):
            continue
    return lines


def drop_checkpoint_before(folder: Path, bad_step: int, is_main: bool) -> Path | None:
    """Remove the checkpoint of step bad_step − 1 (its weights gave the bad loss); the last good one."""
    if is_main:
        shutil.rmtree(folder / f"checkpoint-{bad_step - 1}", ignore_errors=True)
    PartialState().wait_for_everyone()
    return last_checkpoint(folder)


class LossLog(TrainerCallback):
    """Appends each step's LM loss, learning rate and tokens seen to loss.jsonl (first process only), and a
    distilled run's KL and objective.

    A non-finite loss is not logged: it stops training at once and cancels that step's checkpoint.
    """

    def __init__(self, path: Path):
        self.path = path
        self.last_loss = None
        self.bad_loss = self.bad_step = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs:
            return
        if not math.isfinite(logs["loss"]):
            self.bad_loss, self.bad_step = logs["loss"], state.global_step
            control.should_training_stop = True
            control.should_save = False
            return
        self.last_loss = logs.get("lm_loss", logs["loss"])
        if state.is_world_process_zero:
            line = {"step": state.global_step, "loss": self.last_loss, "lr": logs.get("learning_rate"),
                    "tokens": state.num_input_tokens_seen, "grad_norm": logs.get("grad_norm")}
            if "kl" in logs:
                line.update(kl=logs["kl"], objective=logs["loss"])
            with open(self.path, "a") as fh:
                fh.write(json.dumps(line) + "\n")


class AtomicCheckpoints(TrainerCallback):
    """Moves each checkpoint Trainer wrote into .staging to its place, once all processes are done.

    The rename is atomic, so `folder` only ever holds complete checkpoints. The newest two are kept:
    if the next step's loss is not finite, the newest holds the weights that produced it and the one
    before is the last good one. The final step is not checkpointed: the final model follows it.
    """

    def __init__(self, folder: Path):
        self.folder = folder

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = False

    def on_save(self, args, state, control, **kwargs):
        PartialState().wait_for_everyone()
        if state.is_world_process_zero:
            name = f"checkpoint-{state.global_step}"
            os.rename(Path(args.output_dir) / name, self.folder / name)
            for old in checkpoints(self.folder)[:-2]:
                shutil.rmtree(old)
        PartialState().wait_for_everyone()


class ProgressBar(ProgressCallback):
    """Trainer's progress bar (tqdm, on stderr) with the loss as postfix instead of printed dicts."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is not None and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)


def tensorboard(out: Path, args) -> list:
    """A TensorBoard logger writing to out/tensorboard, when tensorboard is installed (first process)."""
    if importlib.util.find_spec("tensorboard") is None or args.process_index != 0:
        return []
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return [TensorBoardCallback(SummaryWriter(str(out / "tensorboard")))]


def save_final(trainer: Trainer, tokenizer, out: Path, record: dict) -> None:
    """The final model and tokenizer into `out`; then run.json marks the run finished.

    An MLA model is saved as a self-contained checkpoint (auto_map, modeling files, model card), like
    the converter's output.
    """
    trainer.save_model(str(out))  # every process: FSDP/DeepSpeed gather the weights here
    if trainer.args.process_index == 0:
        config = trainer.model.config
        if config.model_type == "mla":  # config with auto_map, tokenizer, modeling files, model card
            write_checkpoint_files(config, tokenizer, None, out)
        else:
            tokenizer.save_pretrained(out)
        write_run_record(out, record)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    PartialState().wait_for_everyone()
