"""The RULER-style generators and scoring (mha2mla.evaluate.ruler), without a model.

Prompts are sized by a word counter standing in for a tokenizer, over a made-up prose pool whose
sentences all have one length, so a needle's character offset in the haystack tells its depth.
"""

from __future__ import annotations

import collections
import random

import pytest

from mha2mla.errors import UserError
from mha2mla.evaluate import ruler
from mha2mla.evaluate.ruler import Env, Haystack, Job, make_samples, string_match_all, string_match_part

CONTEXT = 1024
NIAH = [t for t in ruler.TASKS if t.startswith("niah")]


def made_up_words(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6)))
    return sorted(words)


WORDS = made_up_words()
# 400 sentences of 8 six-letter words: every sentence is 55 characters long
POOL = Haystack(tuple(" ".join(random.Random(i).sample(WORDS, 8)).capitalize() + "." for i in range(400)),
                tuple(WORDS))


def env(context: int = CONTEXT) -> Env:
    return Env(POOL, context, str.split)


def samples(task: str, n: int = 3, seed: int = 0, context: int = CONTEXT, spec=None):
    return make_samples(Job(task, spec or ruler.TASKS[task], context, f"{seed}/{task}"), n, env(context))


# ---------------------------------------------------------------- determinism and size

@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_generators_are_deterministic_per_seed_and_fit_the_context(task):
    first, again, other = samples(task), samples(task), samples(task, seed=1)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert len({s.prompt for s in first}) == len(first)                 # samples differ from each other
    budget = CONTEXT - ruler.TASKS[task].max_new_tokens
    assert all(budget * 0.8 < len(s.prompt.split()) <= budget for s in first), [len(s.prompt.split()) for s in first]


def test_a_sample_does_not_depend_on_how_many_are_drawn():
    assert samples("niah_multikey_1", n=2) == samples("niah_multikey_1", n=4)[:2]


def test_a_seed_hides_the_same_needle_at_every_context_length():
    short, long = samples("niah_single_2", n=1, context=512)[0], samples("niah_single_2", n=1, context=2048)[0]
    assert short.outputs == long.outputs and short.needles == long.needles and short.depths == long.depths
    assert len(long.haystack) > 3 * len(short.haystack)


# ---------------------------------------------------------------- where the answer is

def depth_of(sample, needle: str) -> float:
    """The needle's offset, in % of the haystack with the other needles taken out."""
    text = sample.haystack
    for other in sample.needles:
        if other != needle:
            text = text.replace(other, "", 1)
    return 100 * text.index(needle) / (len(text) - len(needle))


@pytest.mark.parametrize("task", NIAH)
def test_each_answer_is_in_the_haystack_once_at_its_stated_depth(task):
    spec = ruler.TASKS[task]
    for sample in samples(task):
        assert len(sample.needles) == len(sample.depths) == max(spec.keys, spec.queries) * spec.values
        for answer in sample.outputs:
            assert sample.prompt.count(answer) == 1, answer                 # nowhere else in the prompt
            assert answer in sample.haystack
            needle = next(n for n in sample.needles if n.endswith(f" {answer}."))
            depth = sample.depths[sample.needles.index(needle)]
            assert depth in ruler.DEPTHS
            assert abs(depth_of(sample, needle) - depth) < 2.5, (depth_of(sample, needle), depth)


def test_the_asked_key_has_one_needle_even_among_distractor_needles():
    for sample in samples("niah_multikey_2") + samples("niah_multikey_3"):
        asked = sample.prompt.rsplit(" for ", 1)[1].split(" mentioned")[0]
        assert sample.haystack.count(f" for {asked} is: ") == 1
        assert sample.haystack.count("One of the special magic") > 10     # the haystack is distractor needles


def test_fixed_depths_put_the_needle_there():
    for depth in (0, 50, 100):
        spec = ruler.replace(ruler.TASKS["niah_single_2"], depths=(depth,))
        for sample in samples("niah_single_2", n=2, spec=spec):
            assert sample.depths == (depth,)
            assert abs(depth_of(sample, sample.needles[0]) - depth) < 1.0


def test_variable_tracking_chains_the_asked_value_through_every_answer():
    for sample in samples("vt"):
        names = sample.outputs
        assert len(names) == 5 and all(len(n) == 5 and n.isupper() for n in names)
        value = sample.haystack.split(f"VAR {names[0]} = ")[1].split()[0]
        assert f"assigned the value {value} in the text above" in sample.prompt
        links = [sample.haystack.index(f"VAR {b} = VAR {a}") for a, b in zip(names, names[1:])]
        assert links == sorted(links)
        assert sample.prompt.index(sample.haystack) > 0                  # after the solved example


@pytest.mark.parametrize("task, top", [("cwe", 10), ("fwe", 3)])
def test_word_extraction_answers_are_the_most_frequent_words(task, top):
    for sample in samples(task):
        words = [w for w in sample.haystack.split() if w != "..." and not w[0].isdigit()]
        counts = collections.Counter(words).most_common()
        assert {w for w, _ in counts[:top]} == set(sample.outputs)
        assert counts[top - 1][1] > counts[top][1]                       # no tie at the cut


# ---------------------------------------------------------------- scoring (RULER's string match)

def test_string_match_all_is_the_fraction_of_references_found():
    assert string_match_all(["The numbers are 1234567 and 7654321."], [["1234567", "7654321", "1111111"]]) == \
        pytest.approx(2 / 3)
    assert string_match_all(["Abc-DEF is it"], [["abc-def"]]) == 1.0     # case-insensitive
    assert string_match_all(["a b", "c"], [["a", "b"], ["d"]]) == 0.5    # mean over samples


def test_string_match_part_is_one_when_any_reference_is_found():
    assert string_match_part(["The numbers are 1234567 and 7654321."], [["1234567", "7654321", "1111111"]]) == 1.0
    # RULER's per-sample max, averaged (lm-eval 0.4.13's copy takes the max over samples: 0.25 here)
    assert string_match_part(["a", "x"], [["a", "b"], ["c"]]) == 0.5
    assert string_match_part(["nothing"], [["a", "b"]]) == 0.0


def test_predictions_are_postprocessed_as_ruler_does():
    assert ruler.postprocess("  \x00 1234567\t\n") == "1234567"
    assert ruler.score_of(" 12\x0134567", ["12\n34567"]) == 1.0
    assert ruler.score_of("VAR ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)


def test_batches_group_prompts_that_generate_alike_within_the_token_budget_shortest_context_first():
    made = samples("niah_single_1", n=2, context=2048) + samples("niah_single_1", n=3) + samples("vt", n=2) + \
        samples("niah_multikey_2", n=3)
    groups = ruler.batches(made, ruler.TASKS, batch_tokens=4096)
    assert [[(s.task, s.context) for s in batch] for batch in groups] == [
        [("niah_single_1", 1024)] * 3 + [("niah_multikey_2", 1024)],
        [("niah_multikey_2", 1024)] * 2,
        [("vt", 1024)] * 2,
        [("niah_single_1", 2048)] * 2,
    ]


# ---------------------------------------------------------------- haystack files and bad input

def test_load_haystack_reads_prose_strips_doc_markup_and_collects_words(tmp_path):
    text = " ".join(" ".join(random.Random(i).sample(WORDS, 8)).capitalize() + "." for i in range(200))
    (tmp_path / "wiki_00").write_text(f'<doc id="1" title="t">\n{text}\n</doc>\n')
    pool = ruler.load_haystack(tmp_path)
    assert len(pool.sentences) == 200 and not any("doc" in s for s in pool.sentences)
    assert set(pool.words) <= set(WORDS) and len(pool.words) >= ruler.MIN_WORDS
    assert ruler.load_haystack(pool) is pool


@pytest.mark.parametrize("call, words", [
    (lambda: ruler.check_tasks("niah_single_1,needle"), ["unknown task needle", "niah_single_1"]),
    (lambda: ruler.check_tasks(""), ["unknown task"]),
    (lambda: ruler.check_depths([0, 50, 150]), ["150", "[0, 100]"]),
    (lambda: ruler.check_depths([-1]), ["-1"]),
    (lambda: ruler.check_samples(0), ["--samples", "≥ 1"]),
    (lambda: ruler.check_contexts([1024, 0]), ["positive"]),
    (lambda: ruler.load_haystack("/nonexistent/haystack"), ["haystack directory not found"]),
    (lambda: samples("cwe", context=128), ["context 128 is too short for cwe"]),
])
def test_bad_input_is_a_user_error(call, words):
    with pytest.raises(UserError) as error:
        call()
    assert all(w in str(error.value) for w in words), str(error.value)


def test_a_haystack_with_too_few_words_is_a_user_error(tmp_path):
    (tmp_path / "a.txt").write_text("The cat sat. " * 100)
    with pytest.raises(UserError, match="distinct words"):
        ruler.load_haystack(tmp_path)
