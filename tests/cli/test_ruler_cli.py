"""`mha2mla eval ruler`, `eval niah --plot` and `eval compare --tasks ruler`, in-process through cli.main(argv).

A tiny random MLA model (and a tiny Llama source for compare) with a byte-level BPE tokenizer trained
here on a made-up prose haystack written to tmp_path; contexts of 512–1024 tokens. A random model
retrieves nothing, so these tests check the plumbing (prompts fit, generation with the latent
cache, tables, JSON, figures) and bad input, not scores.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from mha2mla.cli import main
from mha2mla.evaluate import ruler

POSITIONS = 1024


def made_up_prose(sentences: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(4, 9))) for _ in range(400)})
    return "\n".join(" ".join(rng.sample(words, 10)).capitalize() + "." for _ in range(sentences))


def tiny_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer (2000 tokens) trained on `texts`, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models decode fastest on one thread, and several threads crawl on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(MLA checkpoint dir, Llama source dir, haystack dir)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mha2mla import MLAConfig, MLAForCausalLM

    root = tmp_path_factory.mktemp("ruler_cli")
    prose = made_up_prose()
    (root / "haystack").mkdir()
    (root / "haystack" / "wiki_00").write_text(f'<doc id="1" title="Made up">\n{prose}\n</doc>\n')
    templates = [ruler.NOISE, ruler.NEEDLE, ruler.NIAH_TEMPLATE, ruler.NIAH_ANSWER, ruler.VT_TEMPLATE,
                 ruler.VT_ANSWER, ruler.CWE_TEMPLATE, ruler.CWE_ANSWER, ruler.FWE_TEMPLATE, ruler.FWE_ANSWER]
    tokenizer = tiny_tokenizer([prose] + templates * 20)       # the templates' words become single tokens
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    models = {"mla": MLAForCausalLM(MLAConfig(d_kv=8, rope_pairs=2, kv_residual=4, kv_group_size=4, **sizes)),
              "source": LlamaForCausalLM(LlamaConfig(head_dim=16, **sizes))}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "mla", root / "source", root / "haystack"


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def json_of(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_eval_ruler_prints_a_table_of_tasks_by_length(setup, capsys):
    mla, _, haystack = setup
    tasks = ["niah_multivalue", "cwe", "fwe"]
    code, out, err = run(capsys, "eval", "ruler", mla, "--context", 1024, "--tasks", ",".join(tasks), "--samples", 1,
                         "--haystack", haystack)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("| task \\ context | 1024 |")
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:]] == [*tasks, "**average**"]
    assert "long-context samples" in err                                    # the progress bar, on stderr


def test_eval_ruler_json_with_the_int4_latent_cache(setup, capsys):
    mla, _, haystack = setup
    code, out, err = run(capsys, "eval", "ruler", mla, "--context", "512,768", "--tasks", "niah_single_1,vt",
                         "--samples", 3, "--seed", 7, "--kv-bits", 4, "--haystack", haystack, "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1
    result = json_of(out)
    assert result["tasks"] == ["niah_single_1", "vt"] and result["contexts"] == [512, 768]
    assert result["samples"] == 3 and result["seed"] == 7 and result["kv_bits"] == 4
    assert set(result["results"]["vt"]) == set(result["average"]) == {"512", "768"}
    assert all(0 <= v <= 1 for row in result["results"].values() for v in row.values())


def test_a_killed_run_resumes_from_its_score_file(setup, capsys, tmp_path, monkeypatch):
    """--resume FILE: the scored samples of a first run (cut short: its last line half written) are not
    generated again; a longer run scores only what is missing and reports what one run would; a file of
    another run (another seed) is refused."""
    mla, _, haystack = setup
    common = ["eval", "ruler", mla, "--context", 512, "--tasks", "niah_single_1,vt", "--haystack", haystack, "--json"]
    code, out, err = run(capsys, *common, "--samples", 3)
    assert code == 0, err
    whole = json_of(out)
    log = tmp_path / "scores.jsonl"
    code, out, err = run(capsys, *common, "--samples", 2, "--resume", log)
    assert code == 0, err
    assert len(log.read_text().splitlines()) == 1 + 4                    # the run, then 2 tasks × 2 samples
    with log.open("a") as f:
        f.write('{"task": "vt", "cont')                                   # killed while writing a line
    generated = []
    real = ruler.generate_answers
    monkeypatch.setattr(ruler, "generate_answers", lambda model, tok, batch, *a: generated.extend(batch) or
                        real(model, tok, batch, *a))
    code, out, err = run(capsys, *common, "--samples", 3, "--resume", log)
    assert code == 0, err
    assert sorted((s.task, s.index) for s in generated) == [("niah_single_1", 2), ("vt", 2)]
    assert json_of(out)["results"] == whole["results"]
    code, out, err = run(capsys, *common[:-1], "--samples", 3, "--seed", 1, "--resume", log)
    assert code == 2 and "another run" in err and "--resume" in err


def test_eval_niah_writes_the_heat_map(setup, capsys, tmp_path):
    mla, _, haystack = setup
    code, out, err = run(capsys, "eval", "niah", mla, "--context", "512,768", "--depths", "0,62.5",
                         "--samples", 1, "--haystack", haystack, "--plot", tmp_path / "map", "--json")
    assert code == 0, err
    result = json_of(out)
    assert list(result["results"]) == ["512", "768"] and list(result["results"]["512"]) == ["0", "62.5"]
    assert result["task"] == "niah_single_2" and result["depths"] == [0, 62.5]
    for suffix in (".png", ".svg"):
        assert (tmp_path / f"map{suffix}").stat().st_size > 1000
    assert result["png"].endswith("map.png") and result["svg"].endswith("map.svg")


def test_eval_compare_takes_ruler_as_a_task_group(setup, capsys):
    mla, source, haystack = setup
    code, out, err = run(capsys, "eval", "compare", source, mla, "--tasks", "niah_single_1,vt", "--context", 512,
                         "--limit", 2, "--haystack", haystack, "--json")
    assert code == 0, err
    result = json_of(out)
    assert result["tasks"] == ["ruler@512"]
    source_row, mla_row = result["rows"]
    assert mla_row["kv_bytes_per_token"] < source_row["kv_bytes_per_token"] and mla_row["reduction_pct"] > 0
    assert list(mla_row["ruler"]["results"]) == ["niah_single_1", "vt"] and mla_row["ruler"]["samples"] == 2
    code, out, err = run(capsys, "eval", "compare", source, mla, "--tasks", "ruler", "--context", 512,
                         "--haystack", haystack)
    assert code == 2 and "context 512 is too short for cwe" in err         # `ruler`: every task, checked first


@pytest.mark.parametrize("args, words", [
    (["eval", "ruler", "{mla}", "--context", 2048], ["--context 2048", "1024"]),
    (["eval", "ruler", "{mla}", "--tasks", "niah_single_1,passkey"], ["unknown task passkey"]),
    (["eval", "ruler", "{mla}", "--samples", 0], ["--samples"]),
    (["eval", "ruler", "{mla}", "--haystack", "{missing}"], ["haystack directory not found"]),
    (["eval", "ruler", "{source}", "--kv-bits", 4], ["MLA"]),
    (["eval", "niah", "{mla}", "--depths", "0,150"], ["150", "[0, 100]"]),
    (["eval", "niah", "{mla}", "--depths", "half"], ["--depths"]),
    (["eval", "compare", "{source}", "{mla}", "--tasks", "ruler,arc_easy"], ["ruler is a task group"]),
])
def test_bad_input_is_one_error_line_and_exit_2(setup, capsys, tmp_path, args, words):
    mla, source, haystack = setup
    fill = {"mla": mla, "source": source, "missing": tmp_path / "nothing"}
    argv = [str(a).format(**fill) for a in args]
    if "--haystack" not in argv and argv[1] != "compare":
        argv += ["--haystack", str(haystack)]
    code, out, err = run(capsys, *argv)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert all(w in errors[0] for w in words), errors[0]
