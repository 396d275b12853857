"""Offline distillation targets (apps/distill_targets.py): the top-k KL against the online one, the written
arrays against the teacher, a killed pass resumed, a run distilled from targets against the online run, and
bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny import read_log, small_run
from mha2mla.apps.distill import Distillation, distillation_loss
from mha2mla.apps.distill_targets import TopK, top_logprobs, write_targets
from mha2mla.errors import UserError
from mha2mla.io.text import pack_blocks


def logits(seed: int, shape=(2, 5, 7)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_targets_over_the_whole_vocabulary_give_the_online_loss():
    s, t, labels = logits(0), logits(1), torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(2))
    online = distillation_loss(s, t, labels, 0.3, 2.0)
    offline = distillation_loss(s, TopK(*top_logprobs(t, 7)), labels, 0.3, 2.0)
    for a, b in zip(online, offline):
        assert b.item() == pytest.approx(a.item(), rel=1e-5, abs=1e-6)


def test_the_top_k_kl_is_the_renormalised_teachers_against_the_student():
    s, t, labels = logits(0), logits(1), torch.zeros(2, 5, dtype=torch.long)
    k, T = 3, 1.5
    _, _, kl = distillation_loss(s, TopK(*top_logprobs(t, k)), labels, 1.0, T)
    top = t[:, :-1].topk(k, -1)
    p = (top.values / T).softmax(-1)
    log_q = (s[:, :-1] / T).log_softmax(-1).gather(-1, top.indices)
    assert kl.item() == pytest.approx(((p * (p.log() - log_q)).sum(-1).mean() * T**2).item(), rel=1e-5)
    assert kl.item() > 0


def write(teacher, out, text_dir, steps=3, top_k=5, **kw):
    """Targets of a run of small_run's settings (seq_len 32, batch 2) and `steps` steps; a path teacher as a string."""
    return write_targets(teacher if isinstance(teacher, tuple) else str(teacher), out, [text_dir], steps, seq_len=32, batch_size=2, top_k=top_k,
                         progress=False, **kw)


def test_written_targets_are_the_teachers_top_k(tiny_model, text_dir, tmp_path, one_thread):
    from mha2mla import load_model

    record = write(tiny_model, tmp_path / "targets", text_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["targets"]  # no partial folder left
    teacher, tokenizer = load_model(tiny_model)
    blocks = pack_blocks(tokenizer, [text_dir], 32, 6)
    assert record["blocks"] == 6 and "done" not in json.loads((tmp_path / "targets" / "targets.json").read_text())
    with torch.no_grad():
        expected = teacher(input_ids=blocks).logits.log_softmax(-1).topk(5, -1)
    indices = np.load(tmp_path / "targets" / "indices.npy")
    logprobs = np.load(tmp_path / "targets" / "logprobs.npy")
    assert indices.shape == (6, 32, 5) and indices.dtype == np.int32
    assert torch.equal(torch.from_numpy(indices).long(), expected.indices)
    torch.testing.assert_close(torch.from_numpy(logprobs), expected.values, rtol=1e-5, atol=1e-5)


def test_a_killed_pass_resumes_where_it_stopped(tiny_model, text_dir, tmp_path, one_thread):
    from mha2mla import load_model

    model, tokenizer = load_model(tiny_model)
    forward, calls = model.forward, []

    def dies_on_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    model.forward = dies_on_the_second_batch
    with pytest.raises(KeyboardInterrupt):
        write((model, tokenizer), tmp_path / "resumed", text_dir)
    assert not (tmp_path / "resumed").exists()
    assert json.loads((tmp_path / ".resumed.partial" / "targets.json").read_text())["done"] == 2
    model.forward = forward
    write((model, tokenizer), tmp_path / "resumed", text_dir)
    write(tiny_model, tmp_path / "whole", text_dir)
    for name in ("indices.npy", "logprobs.npy"):
        assert np.array_equal(np.load(tmp_path / "resumed" / name), np.load(tmp_path / "whole" / name))


def test_a_run_distilled_from_whole_vocabulary_targets_is_the_online_run(tiny_model, text_dir, tmp_path, one_thread):
    from tiny import TINY_VOCAB

    write(tiny_model, tmp_path / "targets", text_dir, steps=4, top_k=TINY_VOCAB)
    small_run(str(tiny_model), tmp_path / "offline", text_dir, 4,
              distill=Distillation(targets=str(tmp_path / "targets"), alpha=0.5, temperature=2.0))
    small_run(str(tiny_model), tmp_path / "online", text_dir, 4,
              distill=Distillation(teacher=str(tiny_model), alpha=0.5, temperature=2.0))
    offline, online = read_log(tmp_path / "offline"), read_log(tmp_path / "online")
    assert len(offline) == 4 and offline[-1]["kl"] > 1e-6
    for a, b in zip(offline, online):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6)


def test_targets_of_other_blocks_are_refused(tiny_model, text_dir, tmp_path, one_thread):
    write(tiny_model, tmp_path / "targets", text_dir, steps=2)
    with pytest.raises(UserError, match="other training blocks"):
        small_run(str(tiny_model), tmp_path / "run", text_dir, 3, distill=Distillation(targets=str(tmp_path / "targets")))
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.parametrize("kw, message", [(dict(top_k=0), "--top-k"), (dict(top_k=10**6), "--top-k"),
                                         (dict(steps=0), "--steps")])
def test_bad_settings_are_user_errors(tiny_model, text_dir, tmp_path, kw, message):
    with pytest.raises(UserError, match=message):
        write(tiny_model, tmp_path / "targets", text_dir, **kw)
    assert not any(tmp_path.iterdir())


def test_an_existing_output_or_an_unfinished_pass_of_other_settings_is_refused(tiny_model, text_dir, tmp_path):
    (tmp_path / "done").mkdir()
    with pytest.raises(UserError, match="exists"):
        write(tiny_model, tmp_path / "done", text_dir)
    partial = tmp_path / ".t.partial"
    partial.mkdir()
    (partial / "targets.json").write_text(json.dumps({"top_k": 3, "done": 2}))
    with pytest.raises(UserError, match="other settings"):
        write(tiny_model, tmp_path / "t", text_dir)


def test_a_teacher_and_targets_together_are_refused():
    with pytest.raises(UserError, match="give one"):
        Distillation(teacher="a", targets="b").check()
