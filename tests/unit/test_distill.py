"""Distillation from the source (apps/distill.py): the loss against hand computation, the settings' bad
values, the teacher's checks, and a tiny distilled run's loss log and resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tiny import read_log, small_run
from mha2mla.apps.distill import Distillation, distillation_loss, load_teacher
from mha2mla.errors import UserError


def logits(seed: int, shape=(2, 5, 7)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_loss_is_alpha_kl_plus_lm_by_hand():
    s, t, labels = logits(0), logits(1), torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(2))
    T, alpha = 2.0, 0.3
    total, lm, kl = distillation_loss(s, t, labels, alpha, T)
    expected_lm = F.cross_entropy(s[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    p_t, log_p_t, log_p_s = (t[:, :-1] / T).softmax(-1), (t[:, :-1] / T).log_softmax(-1), (s[:, :-1] / T).log_softmax(-1)
    expected_kl = (p_t * (log_p_t - log_p_s)).sum(-1).mean() * T**2
    assert lm.item() == pytest.approx(expected_lm.item(), rel=1e-6)
    assert kl.item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert total.item() == pytest.approx(alpha * expected_kl.item() + (1 - alpha) * expected_lm.item(), rel=1e-5)


def test_a_student_equal_to_its_teacher_has_zero_kl_and_alpha_zero_is_the_lm_loss():
    s, labels = logits(0), torch.zeros(2, 5, dtype=torch.long)
    total, lm, kl = distillation_loss(s, s.clone(), labels, 1.0, 1.0)
    assert kl.item() == pytest.approx(0.0, abs=1e-6) and total.item() == pytest.approx(0.0, abs=1e-6)
    total, lm, _ = distillation_loss(s, logits(1), labels, 0.0, 1.0)
    assert total.item() == lm.item() and math.isfinite(lm.item())


@pytest.mark.parametrize("settings, message", [(dict(alpha=1.5), "--distill-alpha"), (dict(alpha=-0.1), "--distill-alpha"),
                                               (dict(temperature=0), "--distill-temperature")])
def test_bad_settings_are_user_errors(settings, message):
    with pytest.raises(UserError, match=message):
        Distillation(**settings).check()


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    from tiny import tiny_source, tiny_tokenizer

    other = tmp_path / "other"
    tiny_source(vocab=len(tiny_tokenizer()) + 8).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    from mha2mla import load_model

    student, tokenizer = load_model(tiny_model)
    with pytest.raises(UserError, match="another vocabulary"):
        load_teacher(Distillation(teacher=str(other)), student, tokenizer)


def test_no_recorded_source_and_no_teacher_is_a_user_error(tiny_model):
    from mha2mla import load_model

    student, tokenizer = load_model(tiny_model)
    student.config.source_model = None
    with pytest.raises(UserError, match="--teacher"):
        load_teacher(Distillation(), student, tokenizer)


def test_distilled_run_logs_lm_loss_kl_and_objective(tiny_model, text_dir, tmp_path, one_thread):
    """The log's `loss` is the LM loss (comparable with a plain run), objective = α·KL + (1 − α)·LM; the
    student starts as its teacher, so the first step's KL is zero."""
    distill = Distillation(teacher=str(tiny_model), alpha=0.25)
    whole = small_run(str(tiny_model), tmp_path / "whole", text_dir, 6, distill=distill)
    log = read_log(tmp_path / "whole")
    assert [r["step"] for r in log] == list(range(1, 7))
    for r in log:
        assert r["objective"] == pytest.approx(0.25 * r["kl"] + 0.75 * r["loss"], rel=1e-4) and r["kl"] >= 0
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert log[-1]["kl"] > 1e-6  # the student has moved away from its teacher
    assert whole["teacher_bytes"] > 0 and whole["final_loss"] == log[-1]["loss"]
    plain = small_run(str(tiny_model), tmp_path / "plain", text_dir, 6)
    assert read_log(tmp_path / "plain")[0]["loss"] == pytest.approx(log[0]["loss"], rel=1e-5)  # the same LM loss at step 1
    assert plain["teacher_bytes"] == 0 and "kl" not in read_log(tmp_path / "plain")[0]


def test_resuming_with_other_distillation_settings_is_refused(tiny_model, text_dir, tmp_path, one_thread):
    small_run(str(tiny_model), tmp_path / "run", text_dir, 2, distill=Distillation(teacher=str(tiny_model)))
    (tmp_path / "run" / "run.json").write_text((tmp_path / "run" / "run.json").read_text().replace('"finished": true',
                                                                                                 '"finished": false'))
    with pytest.raises(UserError, match="distill"):
        small_run(str(tiny_model), tmp_path / "run", text_dir, 2, resume=True)


def test_a_loaded_teacher_is_used_as_it_is(tiny_model, text_dir, tmp_path, one_thread):
    """The demo's way: the teacher passed as a loaded model (its name recorded in run.json), left untouched."""
    from mha2mla import load_model

    teacher, _ = load_model(tiny_model)
    before = {n: p.clone() for n, p in teacher.state_dict().items()}
    small_run(str(tiny_model), tmp_path / "run", text_dir, 3, distill=Distillation(teacher=teacher))
    assert read_log(tmp_path / "run")[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(torch.equal(before[n], p) for n, p in teacher.state_dict().items())
    import json

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["settings"]["distill"]["teacher"] == teacher.config._name_or_path
