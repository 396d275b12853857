"""The evaluation suite on the local benchmark files: lm-eval tasks, Table-1 comparison, passkey retrieval.

Document counts and gold answers are checked against the files in ../shared/data/benchmarks; tiny
random models (a source and our own MLAForCausalLM, with the tiny tokenizer) run every task; the real
SmolLM2-135M must beat chance on ARC-Easy and PIQA and find a passkey in 1K tokens (in its own float32:
bfloat16 is faster only on CPUs with AMX/AVX512-BF16 units, and emulated — many times slower — on the
others). HellaSwag's capitalisation: tests/unit/test_tasks.py; the CLI's errors: tests/cli/test_tasks_cli.py.
"""

from __future__ import annotations

import json
import time

import pytest
from tiny import tiny_source

from mha2mla.evaluate.tasks import TASKS, compare_models, evaluate_tasks, load_docs, markdown_table

COUNTS = {"arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "hellaswag": 10042, "openbookqa": 500,
          "winogrande": 1267, "mmlu": 14042}


@pytest.fixture(scope="module")
def docs(data_dir):
    return {task: load_docs(task, data_dir) for task in TASKS}


@pytest.fixture(scope="module")
def tiny_models(tokenizer):
    """A tiny random Llama source and a tiny random MLA model (hidden 32), with the tiny tokenizer."""
    from mha2mla import MLAConfig, MLAForCausalLM

    source = tiny_source(vocab=len(tokenizer), n_heads=4, n_kv=2, head_dim=8)
    config = MLAConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, d_kv=4, rope_pairs=1, max_position_embeddings=512)
    return (source, tokenizer), (MLAForCausalLM(config).eval(), tokenizer)


def test_every_task_reads_its_file(docs):
    assert {task: len(d) for task, d in docs.items()} == COUNTS


def test_gold_answers_of_known_items(docs):
    arc = docs["arc_easy"][0]
    assert arc["id"] == "Mercury_417466" and arc["answerKey"] == "A"
    assert arc["choices"]["text"][0] == "Sunlight is the source of energy for nearly all ecosystems."
    challenge = docs["arc_challenge"][0]
    assert challenge["id"] == "Mercury_7175875" and challenge["answerKey"] == "C"
    assert challenge["choices"]["text"][2] == "Planetary days will become shorter."
    # labels 1-4 instead of A-D occur in ARC; the target is the label's index either way
    numeric = next(d for d in docs["arc_easy"] if d["choices"]["label"][0] == "1")
    assert numeric["answerKey"] in numeric["choices"]["label"]

    piqa = docs["piqa"]
    assert piqa[0]["goal"] == "How do I ready a guinea pig cage for it's new occupants?" and piqa[0]["label"] == 0
    assert [d["label"] for d in piqa[:3]] == [0, 1, 1]

    hs = docs["hellaswag"][0]
    assert hs["query"] == "Roof shingle removal: A man is sitting on a roof. He"  # ctx_b capitalised as lm-eval does
    assert hs["label"] == 3 and hs["choices"][3] == "starts pulling up roofing on a roof."
    assert docs["hellaswag"][1]["label"] == 3 and docs["hellaswag"][1]["choices"][3].startswith("stands and lifts")

    obqa = docs["openbookqa"]
    assert obqa[0]["question_stem"].startswith("A person wants to start saving money") and obqa[0]["answerKey"] == "B"
    assert obqa[1]["question_stem"] == "There is most likely going to be fog around:" and obqa[1]["answerKey"] == "A"

    wg = docs["winogrande"][0]
    assert wg["sentence"] == "Sarah was a much better surgeon than Maria so _ always got the easier cases."
    assert wg["answer"] == "2" and docs["winogrande"][1]["answer"] == "1"

    mmlu = docs["mmlu"]
    assert mmlu[0]["subject"] == "abstract_algebra" and mmlu[0]["choices"] == ["0", "4", "2", "6"]
    assert mmlu[0]["answer"] == 1  # "B"
    assert mmlu[1]["subject"] == "anatomy"  # subjects interleaved, so a limit samples all 57
    assert len({d["subject"] for d in mmlu[:57]}) == 57
    assert "0,1" in next(d for d in mmlu if d["question"].startswith("Find all zeros in the indicated"))["choices"]


def test_prompts_are_lm_eval_formulations(docs):
    from mha2mla.evaluate.tasks import build_task

    def first(task):
        t = build_task(task, docs[task][:2])
        doc = t.eval_docs[0]
        return t.fewshot_context(doc, 0), t.doc_to_choice(doc), t.doc_to_target(doc)

    assert first("arc_easy")[0] == ("Question: Which statement best explains why photosynthesis is the foundation "
                                    "of most food webs?\nAnswer:")
    assert first("arc_challenge")[2] == 2
    assert first("piqa")[0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert first("hellaswag")[1:] == (docs["hellaswag"][0]["choices"], 3)
    assert first("openbookqa")[2] == 1
    contexts, _, target = first("winogrande")  # partial evaluation: one context per option, shared target
    assert contexts == ["Sarah was a much better surgeon than Maria so Sarah",
                        "Sarah was a much better surgeon than Maria so Maria"]
    assert target == "always got the easier cases."
    text, choices, target = first("mmlu")
    assert text.startswith("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
                           "Find the degree for the given field extension")
    assert text.endswith("\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:") and choices == ["A", "B", "C", "D"] and target == 1


def test_tiny_models_run_every_task(tiny_models, data_dir):
    source, mla = tiny_models
    for pair in (source, mla):
        out = evaluate_tasks(pair, TASKS, limit=3, data_dir=data_dir, batch_size=4)
        assert set(out["results"]) == set(TASKS)
        for task, r in out["results"].items():
            assert r["n"] == 3 and r["acc"] * 3 == pytest.approx(round(r["acc"] * 3))   # k of 3 right
            assert (r["acc_norm"] is None) == (task in ("winogrande", "mmlu"))
        scores = [r["acc_norm"] if r["acc_norm"] is not None else r["acc"] for r in out["results"].values()]
        assert out["average"] == pytest.approx(sum(scores) / len(scores))
        json.dumps(out)


def test_compare_rows_and_markdown(tiny_models, data_dir):
    source, mla = tiny_models
    table = compare_models([source, mla], ["piqa", "winogrande"], limit=2, data_dir=data_dir, batch_size=4)
    first, second = table["rows"]
    assert first["reduction_pct"] == 0.0 and first["kv_bytes_per_token"] == 2 * 2 * 8 * 2
    assert second["kv_bytes_per_token"] == (2 * 4 + 2 * 2) * 2 and second["reduction_pct"] == pytest.approx(62.5)
    assert first["results"]["piqa"]["n"] == 2
    md = markdown_table(table)
    print("\n" + md)
    assert md.count("\n") == 3 and "| piqa | winogrande |" in md and "-62.50%" in md


def test_dtype_cast_leaves_the_callers_model_alone(tiny_models, data_dir):
    import torch

    source = tiny_models[0]
    evaluate_tasks(source, ["openbookqa"], limit=1, data_dir=data_dir, dtype="bfloat16")
    assert source[0].dtype == torch.float32


def test_smollm2_beats_chance_on_arc_easy_and_piqa(smollm2, data_dir):
    start = time.perf_counter()
    out = evaluate_tasks(smollm2, ["arc_easy", "piqa"], limit=200, data_dir=data_dir)
    arc, piqa = out["results"]["arc_easy"], out["results"]["piqa"]
    print(f"\nSmolLM2-135M, limit 200, fp32: ARC-Easy acc {arc['acc']:.3f} acc_norm {arc['acc_norm']:.3f}; "
          f"PIQA acc {piqa['acc']:.3f} acc_norm {piqa['acc_norm']:.3f} ({time.perf_counter() - start:.0f} s)")
    assert arc["n"] == piqa["n"] == 200
    assert arc["acc"] > 0.35 and arc["acc_norm"] > 0.35  # chance 0.25 (4 choices)
    assert piqa["acc"] > 0.58 and piqa["acc_norm"] > 0.58  # chance 0.5


def test_smollm2_finds_the_passkey_at_1k(smollm2):
    from mha2mla.evaluate.passkey import passkey_accuracy, passkey_prompt

    tokenizer = smollm2[1]
    n = len(tokenizer(passkey_prompt(tokenizer, 1024, 12345, 0.5))["input_ids"])
    assert 950 <= n <= 1024
    out = passkey_accuracy(smollm2, [1024], seeds=5)
    print(f"\npasskey at 1K: {out}")
    assert out["results"]["1024"] == {"accuracy": 1.0, "n": 5}
