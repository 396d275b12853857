"""Zero-shot multiple-choice benchmarks through EleutherAI's lm-eval harness, from local files.

Seven tasks: arc_easy, arc_challenge, piqa, hellaswag, openbookqa, winogrande, mmlu. Each is an
lm-eval `ConfigurableTask` whose prompt, choices, target and metrics copy lm-eval's own YAML for
that task (lm_eval/tasks/<task>/*.yaml); only the documents come from elsewhere: the offline copies
in <data>/benchmarks (../shared/data or $MHA2MLA_DATA_DIR), converted to the Hugging Face schema the
official config reads. Without the files, the official hub dataset is used when online.

Differences from the hub copies, both forced by the offline formats:
* HellaSwag comes as llama.cpp text with lm-eval's preprocessing already applied; its context is
  `ctx_a + " " + ctx_b` unsplit, so lm-eval's `ctx_b.capitalize()` is redone as "upper-case the
  first letter of the last sentence fragment".
* MMLU is one task over all 57 subjects (each question keeps its subject's description), interleaved
  across subjects so that `limit` takes a balanced sample. Over the full set its acc equals lm-eval's
  `mmlu` group acc (which weights subjects by size).

Models run through lm-eval's HFLM wrapper around the model instance, so an MLA checkpoint is
evaluated by our own MLAForCausalLM. `compare_models` builds the MHA2MLA paper's Table 1 rows.
"""

from __future__ import annotations

import bz2
import copy
import csv
import errno
import itertools
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlparse

from ..errors import UserError
from ..io.sources import load_model, torch_dtype
from ..io.text import data_dir as default_data_dir
from ..modeling.configuration_mla import kv_report

TASKS = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande", "mmlu")

_ACC = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
_ACC_NORM = _ACC + [{"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]
_MMLU_DESCRIPTION = ("The following are multiple choice questions (with answers) about "
                     "{{subject.replace('_', ' ')}}.\n\n")
_MMLU_TEXT = ("{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
              "D. {{choices[3]}}\nAnswer:")


# ---------------------------------------------------------------- local files → HF-schema documents

def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _arc_docs(root: Path, name: str) -> list[dict]:
    """ARC-Easy / ARC-Challenge test, as allenai/ai2_arc rows."""
    return [{"id": row["id"], "question": row["question"]["stem"],
             "choices": {"text": [c["text"] for c in row["question"]["choices"]],
                         "label": [c["label"] for c in row["question"]["choices"]]},
             "answerKey": row["answerKey"]}
            for row in _jsonl(root / "arc" / name / f"{name}-Test.jsonl")]


def _piqa_docs(root: Path) -> list[dict]:
    """PIQA dev (the hub's validation split): goal, sol1, sol2 and the label from the .lst file."""
    rows = _jsonl(root / "piqa" / "valid.jsonl")
    labels = _lines(root / "piqa" / "valid-labels.lst")
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(label)}
            for r, label in zip(rows, labels, strict=True)]


def capitalize_last_fragment(ctx: str) -> str:
    """Upper-case the first letter after the last sentence end (HellaSwag's ctx_b.capitalize())."""
    head, sep, tail = max((ctx.rpartition(end) for end in (". ", "! ", "? ", ": ")), key=lambda p: len(p[0]))
    return head + sep + tail[:1].upper() + tail[1:] if sep else ctx


def _hellaswag_docs(root: Path) -> list[dict]:
    """HellaSwag validation from the llama.cpp text: 6 lines per task (context, gold, 4 endings)."""
    with bz2.open(root / "hellaswag" / "hellaswag_val_full.txt.bz2", "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    return [{"query": capitalize_last_fragment(lines[i]), "choices": lines[i + 2:i + 6], "label": int(lines[i + 1])}
            for i in range(0, len(lines) - 5, 6)]


def _winogrande_docs(root: Path) -> list[dict]:
    """WinoGrande v1.1 dev (winogrande_xl validation on the hub)."""
    folder = root / "winogrande" / "winogrande_1.1"
    return [{k: r[k] for k in ("sentence", "option1", "option2", "answer")} for r in _jsonl(folder / "dev.jsonl")]


def _openbookqa_docs(root: Path) -> list[dict]:
    """OpenBookQA main test from llm-foundry's {"query","choices","gold"} rows, as allenai/openbookqa rows."""
    labels = "ABCDEFGH"
    return [{"question_stem": r["query"], "choices": {"text": r["choices"], "label": list(labels[:len(r["choices"])])},
             "answerKey": labels[r["gold"]]}
            for r in _jsonl(root / "openbookqa" / "openbook_qa.jsonl")]


def _mmlu_docs(root: Path) -> list[dict]:
    """MMLU test, all 57 subjects (headerless csv: question, A, B, C, D, answer), as cais/mmlu rows."""
    files = sorted((root / "mmlu" / "test").glob("*_test.csv"))
    if not files:
        raise FileNotFoundError(errno.ENOENT, "no *_test.csv files", str(root / "mmlu" / "test"))
    subjects = []
    for f in files:
        with open(f, encoding="utf-8", newline="") as fh:
            subjects.append([{"question": q, "subject": f.name[:-len("_test.csv")], "choices": [a, b, c, d],
                              "answer": "ABCD".index(ans.strip())} for q, a, b, c, d, ans in csv.reader(fh)])
    return interleave(subjects)


def interleave(groups: Sequence[Sequence[dict]]) -> list[dict]:
    """Round-robin over the groups: the first n documents sample every group evenly."""
    return [d for batch in itertools.zip_longest(*groups) for d in batch if d is not None]


_LOCAL: dict[str, Callable[[Path], list[dict]]] = {
    "arc_easy": lambda root: _arc_docs(root, "ARC-Easy"),
    "arc_challenge": lambda root: _arc_docs(root, "ARC-Challenge"),
    "piqa": _piqa_docs,
    "hellaswag": _hellaswag_docs,
    "openbookqa": _openbookqa_docs,
    "winogrande": _winogrande_docs,
    "mmlu": _mmlu_docs,
}


# ---------------------------------------------------------------- hub fallback (online only)

def _hellaswag_hub(rows) -> list[dict]:
    from lm_eval.tasks.hellaswag.utils import process_docs

    return [{"query": d["query"], "choices": d["choices"], "label": d["gold"]} for d in process_docs(rows)]


def _mmlu_hub(rows) -> list[dict]:
    by_subject = itertools.groupby(sorted(rows, key=lambda r: r["subject"]), key=lambda r: r["subject"])
    return interleave([list(docs) for _, docs in by_subject])


# task → (hub path, config name, split, conversion of the rows to our documents)
_HUB = {
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", list),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", list),
    "piqa": ("baber/piqa", None, "validation", list),
    "hellaswag": ("Rowan/hellaswag", None, "validation", _hellaswag_hub),
    "openbookqa": ("allenai/openbookqa", "main", "test", list),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", list),
    "mmlu": ("cais/mmlu", "all", "test", _mmlu_hub),
}


def _hub_reachable() -> bool:
    """False when told to stay offline or when the hub's host cannot be reached within 3 s."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


def _hub_docs(task: str, reason: str) -> list[dict]:
    fix = ("put the benchmark files in ../shared/data/benchmarks or $MHA2MLA_DATA_DIR/benchmarks "
           "(or pass --data-dir), or go online to use the Hugging Face Hub copy")
    if not _hub_reachable():
        raise UserError(f"{task}: {reason}, and the Hugging Face Hub is out of reach: {fix}")
    path, name, split, convert = _HUB[task]
    print(f"{task}: {reason}; downloading {path} from the Hugging Face Hub", file=sys.stderr)
    try:
        import datasets

        return convert(datasets.load_dataset(path, name, split=split))
    except Exception as e:  # no network, hub refusal, missing package: all are "go fetch the files"
        raise UserError(f"{task}: {reason}, and the hub copy {path} could not be loaded "
                        f"({type(e).__name__}): {fix}") from None


def benchmarks_root(data_dir: str | os.PathLike | None = None) -> Path | None:
    """<data>/benchmarks (or <data> itself when it holds the task folders); None when there is no data dir."""
    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"data directory not found: {data_dir} (give the folder holding benchmarks/)")
    base = Path(data_dir) if data_dir is not None else default_data_dir()
    if base is None or not base.is_dir():
        return None
    return base / "benchmarks" if (base / "benchmarks").is_dir() else base


def load_docs(task: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """The evaluation documents of one task, in the schema its lm-eval config reads."""
    check_tasks([task])
    root = benchmarks_root(data_dir)
    if root is None:
        return _hub_docs(task, "no offline data directory found")
    try:
        return _LOCAL[task](root)
    except FileNotFoundError as e:
        return _hub_docs(task, f"benchmark file {e.filename} not found")


# ---------------------------------------------------------------- lm-eval task configs

def _config(task: str) -> dict:
    """lm-eval's own prompt/choice/target/metric settings for the task (copied from its YAML)."""
    if task in ("arc_easy", "arc_challenge"):
        return {"doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{choices.label.index(answerKey)}}",
                "doc_to_choice": "{{choices.text}}", "metric_list": _ACC_NORM}
    if task == "piqa":
        return {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
                "doc_to_choice": "{{[sol1, sol2]}}", "metric_list": _ACC_NORM}
    if task == "hellaswag":
        return {"doc_to_text": "{{query}}", "doc_to_target": "{{label}}", "doc_to_choice": "choices",
                "metric_list": _ACC_NORM}
    if task == "openbookqa":
        return {"doc_to_text": "question_stem", "doc_to_target": "{{choices.label.index(answerKey.lstrip())}}",
                "doc_to_choice": "{{choices.text}}", "metric_list": _ACC_NORM}
    if task == "winogrande":
        from lm_eval.tasks.winogrande import preprocess_winogrande as wg  # partial evaluation

        return {"doc_to_text": wg.doc_to_text, "doc_to_target": wg.doc_to_target,
                "doc_to_choice": wg.doc_to_choice, "metric_list": _ACC}
    return {"description": _MMLU_DESCRIPTION, "doc_to_text": _MMLU_TEXT, "doc_to_choice": ["A", "B", "C", "D"],
            "doc_to_target": "answer", "metric_list": _ACC}


def build_task(task: str, docs: list[dict]):
    """An lm-eval ConfigurableTask over the given documents (zero-shot, test split)."""
    import datasets
    from lm_eval.api.task import ConfigurableTask

    dataset = datasets.Dataset.from_list(docs)
    config = {"task": task, "output_type": "multiple_choice", "test_split": "test", "num_fewshot": 0,
              "custom_dataset": lambda **_: {"test": dataset}, "metadata": {"version": 1.0}, **_config(task)}
    logger = logging.getLogger("lm_eval.api.task")  # silence its "custom kwargs via --metadata" hint
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return ConfigurableTask(config=config)
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------- running

def check_tasks(tasks: str | Sequence[str]) -> list[str]:
    """The task names as a list (a string is split at commas); a UserError for an unknown one."""
    tasks = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UserError(f"unknown task {', '.join(unknown) or '(none given)'}: known tasks are {', '.join(TASKS)}")
    return tasks


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise UserError(f"--limit must be a whole number of documents ≥ 1 (got {limit})")


def as_model(model_or_path, dtype=None):
    """(model, tokenizer) from a path/alias (loaded with load_model) or an already loaded pair.

    With `dtype`, a loaded pair's model is copied before the cast: the caller's model is left as it was.
    """
    dtype = torch_dtype(dtype)
    if isinstance(model_or_path, (str, os.PathLike)):
        return load_model(model_or_path, dtype=dtype)
    model, tokenizer = model_or_path
    if dtype is not None and model.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    return model.eval(), tokenizer


def model_name(model_or_path) -> str:
    if isinstance(model_or_path, (str, os.PathLike)):
        return str(model_or_path)
    return str(getattr(model_or_path[0].config, "_name_or_path", "") or type(model_or_path[0]).__name__)


def _score(result: dict) -> float:
    return result["acc_norm"] if result["acc_norm"] is not None else result["acc"]


def run_task(lm, task: str, docs: list[dict], limit: int | None) -> dict:
    """{"acc", "acc_norm" (None where lm-eval defines none), "n"} of one task."""
    from lm_eval.evaluator import evaluate

    out = evaluate(lm, {"tasks": {task: build_task(task, docs)}, "groups": {}}, limit=limit,
                   bootstrap_iters=0, log_samples=False)
    metrics = out["results"][task]
    return {"acc": float(metrics["acc,none"]),
            "acc_norm": float(metrics["acc_norm,none"]) if "acc_norm,none" in metrics else None,
            "n": int(out["n-samples"][task]["effective"])}


def evaluate_tasks(model_or_path, tasks: str | Sequence[str] = TASKS, limit: int | None = None,
                   data_dir: str | os.PathLike | None = None, batch_size: int = 8, dtype=None) -> dict:
    """Zero-shot acc / acc_norm per task and their average (acc_norm where reported, else acc).

    `model_or_path`: a path, hub id, .gguf or alias for `load_model`, or a (model, tokenizer) pair.
    `limit`: the first N documents of each task. `dtype`: run in this dtype (e.g. "bfloat16", much
    faster on CPUs with AMX/AVX512-BF16); None keeps the model's own. Log-softmax is always float32.
    Returns the `eval tasks` JSON of DESIGN.md.
    """
    documents = _checked_documents(tasks, limit, data_dir, batch_size)
    return _evaluate(as_model(model_or_path, dtype), documents, limit, batch_size)


def _checked_documents(tasks: Sequence[str], limit: int | None, data_dir, batch_size: int) -> dict[str, list[dict]]:
    """Every argument and data file checked (and read) before any model is loaded."""
    tasks = check_tasks(tasks)
    check_limit(limit)
    if batch_size < 1:
        raise UserError(f"--batch-size must be ≥ 1 (got {batch_size})")
    return {t: load_docs(t, data_dir) for t in tasks}


def _evaluate(pair, documents: dict[str, list[dict]], limit: int | None, batch_size: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = pair
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
              softmax_dtype="float32")
    results = {}
    for i, (task, docs) in enumerate(documents.items(), 1):
        tag = f"[{i}/{len(documents)}] {task}"
        print(f"{tag}: {len(docs) if limit is None else min(limit, len(docs))} of {len(docs)} documents",
              file=sys.stderr)
        start = time.perf_counter()
        r = results[task] = run_task(lm, task, docs, limit)
        norm = f", acc_norm {r['acc_norm']:.4f}" if r["acc_norm"] is not None else ""
        print(f"{tag}: acc {r['acc']:.4f}{norm} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return {"results": results, "average": sum(map(_score, results.values())) / len(results)}


# ---------------------------------------------------------------- the paper's Table 1

def compare_models(models: Sequence, tasks: str | Sequence[str] = TASKS, limit: int | None = None,
                   data_dir: str | os.PathLike | None = None, batch_size: int = 8, dtype=None, suite=None) -> dict:
    """One row per model (the first is the source): task scores, average, KV bytes and reduction.

    The KV reduction of every row is measured against the first model. Each model is loaded, run
    and released in turn. `suite`: a task group scoring a (model, tokenizer) pair in place of the
    lm-eval tasks, pair → {"results": {COLUMN: {"acc", "acc_norm", "n"}}, "average", …} (the `ruler`
    group: evaluate.ruler.ruler_suite). Returns {"tasks", "limit", "rows": [{"model", "results",
    "average", "kv_bytes_per_token", "reduction_pct", "seconds"}]}.
    """
    if not models:
        raise UserError("give at least one model (the source first)")
    torch_dtype(dtype)
    documents = _checked_documents(tasks, limit, data_dir, batch_size) if suite is None else None
    rows, source_config = [], None
    for spec in models:
        print(f"== {model_name(spec)}", file=sys.stderr)
        start = time.perf_counter()
        pair = as_model(spec, dtype)
        source_config = source_config or pair[0].config
        scores = suite(pair) if suite is not None else _evaluate(pair, documents, limit, batch_size)
        kv = kv_report(pair[0].config, source_config=source_config)
        rows.append({"model": model_name(spec), **scores, "kv_bytes_per_token": kv["kv_bytes_per_token"],
                     "reduction_pct": kv["reduction_pct"], "seconds": time.perf_counter() - start})
        del pair
    return {"tasks": list(rows[0]["results"]), "limit": limit, "rows": rows}


def markdown_table(table: dict) -> str:
    """Table 1 layout: model, KV bytes per token per layer, KV reduction, average, one column per task (%)."""
    header = ["Model", "KV B/token/layer", "KV Δ", "Avg.", *table["tasks"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in table["rows"]:
        reduction = f"-{row['reduction_pct']:.2f}%" if row["reduction_pct"] else "0%"
        cells = [row["model"], str(row["kv_bytes_per_token"]), reduction,
                 f"{100 * row['average']:.2f}", *(f"{100 * _score(row['results'][t]):.2f}" for t in table["tasks"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
