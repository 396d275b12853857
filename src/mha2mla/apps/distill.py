"""Distillation: the source model as the teacher of its MLA conversion during fine-tuning.

The source is always at hand — it is what was converted — so recovery can match its next-token
distribution instead of only the text's. With student logits s, teacher logits t, temperature T and
weight α, per token,

    loss = α · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) · CE(s, next token)

(the KL averaged over tokens; T² keeps its gradient's scale as T changes, Hinton et al. 2015). The
teacher is frozen: no gradients, no optimizer state; it runs in the student's dtype on the student's
device, inside the same autocast, so it adds its weights and one forward's activations to memory.
Under DDP every process holds a full teacher beside its replica of the student. FSDP and DeepSpeed
ZeRO-3 shard the student only: the teacher stays whole on each device, which is fine while it fits
beside the student's shard (else prepare it with the accelerator as an inference-only module).

Where the teacher does not fit beside the student, its top-k log-probabilities over the run's blocks
are written once beforehand (apps/distill_targets.py) and read in place of its forward; the KL is then
taken over those k tokens.

DistillationTrainer is transformers' Trainer with this loss; it logs the LM part as `lm_loss` and the
KL as `kl`, so the logged LM loss of a distilled run stays comparable with a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Trainer

from ..errors import UserError
from ..io.sources import load_model
from .distill_targets import TopK

ALPHA = 1.0        # weight of the KL against the LM loss (measured: docs/experiments.md, recovery round 3)
TEMPERATURE = 1.0


@dataclass(frozen=True)
class Distillation:
    """Distillation settings: the teacher (a path or alias, a loaded model, or None: the source the MLA config
    records), α, T; or, instead of a teacher, a folder of its offline top-k targets."""
    teacher: object = None
    alpha: float = ALPHA
    temperature: float = TEMPERATURE
    targets: str | None = None

    def check(self) -> "Distillation":
        if self.targets is not None and self.teacher is not None:
            raise UserError("--teacher and --distill-targets both name the teacher's outputs: give one")
        if not 0 <= self.alpha <= 1:
            raise UserError(f"--distill-alpha must be in [0, 1] (got {self.alpha})")
        if not self.temperature > 0:
            raise UserError(f"--distill-temperature must be positive (got {self.temperature})")
        return self


def load_teacher(distillation: Distillation, student, tokenizer):
    """The teacher model in eval mode and the student's dtype (frozen: it only ever runs without gradients); a
    UserError for one that cannot teach this student (no teacher known, another vocabulary or tokenizer).
    A loaded teacher is used as it is and must share the student's tokenizer."""
    if distillation.teacher is not None and not isinstance(distillation.teacher, str):
        return distillation.teacher.to(student.dtype).eval()
    name = distillation.teacher or getattr(student.config, "source_model", None)
    if not name:
        raise UserError("no teacher to distil from: the model records no source (pass --teacher SOURCE)")
    teacher, teacher_tokenizer = load_model(name)
    if teacher.config.vocab_size != student.config.vocab_size or teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the teacher {name} has another vocabulary or tokenizer than the model trained "
                        f"({teacher.config.vocab_size} vs {student.config.vocab_size} tokens): give the model it "
                        f"was converted from (--teacher)")
    return teacher.to(student.dtype).eval()


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, LM loss, KL) for the student's logits [B, T, V], the teacher's (logits [B, T, V], or its offline
    TopK) and labels [B, T] (the next token of position i is labels[i + 1], as transformers' causal-LM loss
    shifts them)."""
    s = student[:, :-1].float().flatten(0, 1)
    lm = F.cross_entropy(s, labels[:, 1:].flatten())
    log_q = F.log_softmax(s / temperature, -1)
    if isinstance(teacher, TopK):  # the KL over the teacher's top k, its part renormalised
        log_q = log_q.gather(-1, teacher.indices[:, :-1].flatten(0, 1).long())
        teacher = teacher.logprobs
    log_p = F.log_softmax(teacher[:, :-1].float().flatten(0, 1) / temperature, -1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature**2
    return alpha * kl + (1 - alpha) * lm, lm, kl


class DistillationTrainer(Trainer):
    """Trainer whose loss is distillation_loss against a frozen teacher, or its offline Targets (then each
    batch carries its blocks' indices as `block`)."""

    def __init__(self, *args, teacher=None, targets=None, distillation: Distillation, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.targets, self.distillation = teacher, targets, distillation
        self.model_accepts_loss_kwargs = False  # the loss is a mean per micro-batch: Trainer averages accumulation
        self.parts: list[torch.Tensor] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        if self.targets is not None:
            teacher = self.targets.batch(inputs["block"], outputs.logits.device)
        else:
            device = next(model.parameters()).device
            if next(self.teacher.parameters()).device != device:
                self.teacher.to(device)
            with torch.no_grad():
                teacher = self.teacher(input_ids=inputs["input_ids"]).logits
        loss, lm, kl = distillation_loss(outputs.logits, teacher, inputs["labels"], self.distillation.alpha,
                                         self.distillation.temperature)
        self.parts.append(torch.stack([lm.detach(), kl.detach()]))
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs and self.parts:
            lm, kl = self.accelerator.gather(torch.stack(self.parts).mean(0)[None]).mean(0).tolist()
            logs.update(lm_loss=lm, kl=kl)
            self.parts.clear()
        super().log(logs, *args, **kwargs)
