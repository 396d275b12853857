"""Long-context retention: RULER's synthetic tasks and a needle-in-a-haystack grid, generated offline per seed.

RULER (Hsieh et al., 2024, NVIDIA/RULER) asks a model to retrieve, track and aggregate facts spread
through a long prompt. lm-eval ships a port (lm_eval/tasks/ruler), but it cannot run here: its
modules import `wonderwords` (not installed) and download nltk's punkt_tab when imported, its prose
haystack is Paul Graham's essays from the Hugging Face Hub (`get_haystack` takes no path), it loads
the tokenizer by hub name, and its needles come from the global `random` state, so a sample is not
a function of a seed. The tasks are therefore generated here, with RULER's templates, settings and
scoring (as in NVIDIA/RULER scripts/data/synthetic and lm-eval's copy):

  task             haystack  needle key → value        needles
  niah_single_1    noise     word → 7-digit number     1
  niah_single_2    prose     word → number             1
  niah_single_3    prose     word → UUID               1
  niah_multikey_1  prose     word → number             4 keys, one asked
  niah_multikey_2  needle    word → number             1, among distractor needles filling the haystack
  niah_multikey_3  needle    UUID → UUID               1, among distractor needles
  niah_multivalue  prose     word → number             4 values of one key, all asked
  niah_multiquery  prose     word → number             4 keys, all asked
  vt               noise     variable tracking: one chain of 4 hops (VAR B = VAR A …), all 5 names asked
  cwe              —         common words: the 10 words repeated most in a numbered list (with an example)
  fwe              —         frequent words: the 3 most frequent coded words of a Zipf (α = 2) text

Haystacks: "noise" repeats RULER's filler paragraph (the passkey filler; the control), "prose" is
real text, by default the offline Wikipedia shards, standing in for the essays. A needle reads "One
of the special magic numbers for {key} is: {value}."; needles go in between sentences at depths
drawn from RULER's 40 evenly spaced depths in [0, 100] (% of the haystack's sentences), and each
sample records every needle's depth. The haystack is the largest that keeps the prompt plus the
task's generation budget (niah 128, vt 30, cwe 120, fwe 50 tokens) within the context length.

Scoring as RULER scores: a prediction is stripped and its control characters become newlines;
string_match_all is the fraction of the references found in it and string_match_part is 1 when any
is (both case-insensitive). Every task here uses "all" (RULER keeps "part" for its QA tasks, which
need downloaded data and are left out). A task's score is the mean over its samples; a length's
average is the mean over tasks.

Differences from RULER, each forced by being offline or harmless to the score:
* words are the haystack text's own vocabulary (its frequent lowercase words of 4–10 letters, the
  100 most frequent skipped), not wonderwords' lists: keys are "word-word" pairs as RULER's
  "adjective-noun", and cwe draws its words from the same list;
* sentences are split by a regular expression (RULER: nltk's sent_tokenize, whose data is a download);
* RULER draws uniform line positions in its noise and needle haystacks; here every haystack uses depths;
* a key or value is redrawn while it occurs in the haystack or clashes with another needle's, so every
  answer occurs once in the prompt, at its stated depth (RULER leaves this to chance);
* vt's in-context example is sized to min(500, context/4) tokens (RULER: 500, the same at its
  lengths ≥ 2K) and drawn from the sample's own seed instead of being renamed;
* generation of a sample stops once its score is 1 (every reference found): more text cannot lower a
  string-match score, so the score is the one the full 128-token answer gets.

Deterministic: sample i of task T under seed S draws from random.Random(f"{S}/{T}/{i}") (the same
draws at every context length, so lengths are comparable); the niah grid uses one key per sample
across all depths and lengths. Prompts are built and checked before anything is generated.
Generation is greedy through `generate()`, so an MLA model decodes with its LatentCache (int4/int2
with `kv_bits`); samples of one length and generation budget (e.g. every needle task's) run in
left-padded batches of up to BATCH_TOKENS // context prompts.
"""

from __future__ import annotations

import collections
import random
import re
import string
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from ..errors import UserError
from ..io.text import default_train_text, read_documents
from ..modeling import LatentCache
from ..modeling.modeling_mla import CACHE_NAME
from .inputs import check_fits_context, check_kv_bits
from .passkey import FILLER
from .score_log import ScoreLog
from .tasks import as_model, model_name

CONTEXTS = (1024, 2048, 4096)
SAMPLES = 20
DEPTHS = tuple(round(100 * i / 39) for i in range(40))      # RULER's np.linspace(0, 100, 40), rounded
BATCH_TOKENS = 8192          # prompt tokens per generate() batch
POOL_CHARS = 1_000_000       # prose read from the haystack folder (Wikipedia: ~250K tokens)
VOCABULARY = 2000            # words kept for keys and cwe
SKIP_COMMON = 100            # the most frequent words (articles, pronouns…) skipped
MIN_WORDS = 50
MAX_DRAWS = 1000
NIAH_GRID_TASK = "niah_single_2"

NOISE = FILLER.strip()       # "The grass is green. The sky is blue. …": RULER's repeated haystack
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
                 "the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                "words in the above list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_WORD = re.compile(r"\b[a-z]{4,10}\b")
_CONTROL = re.compile(r"[\x00-\x1f]")


# ---------------------------------------------------------------- scoring (RULER's)

def postprocess(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters → newline, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of a sample's references found in its prediction (RULER, as a fraction)."""
    return sum(sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs)) / len(preds)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of 1 when any of a sample's references is in its prediction (RULER, as a fraction)."""
    return sum(max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs)) / len(preds)


METRICS = {"all": string_match_all, "part": string_match_part}


def score_of(prediction: str, references: Sequence[str], metric: str = "all") -> float:
    """One generated answer's score."""
    return METRICS[metric]([postprocess(prediction)], [references])


# ---------------------------------------------------------------- haystack text

@dataclass(frozen=True, eq=False)
class Haystack:
    """Prose sentences (read in order, used as a ring) and the vocabulary drawn for keys and word lists."""
    sentences: tuple[str, ...]
    words: tuple[str, ...]

    def window(self, start: int, n: int) -> list[str]:
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(n)]


def haystack_dir(path=None) -> Path:
    """The haystack folder (or file): `path`, else the offline Wikipedia shards."""
    if path is None:
        try:
            return default_train_text()
        except UserError:
            raise UserError("no haystack text found: pass --haystack DIR (a folder of text files), or set "
                            "MHA2MLA_DATA_DIR to a folder holding text/wikipedia-en-2015-wikiextractor") from None
    if not Path(path).exists():
        raise UserError(f"haystack directory not found: {path} (give a folder of text files, e.g. the "
                        f"Wikipedia shards)")
    return Path(path)


def vocabulary(text: str) -> tuple[str, ...]:
    """The text's frequent lowercase words of 4–10 letters, the most frequent skipped, alphabetically."""
    ranked = [w for w, _ in sorted(collections.Counter(_WORD.findall(text)).items(), key=lambda kv: (-kv[1], kv[0]))]
    return tuple(sorted(ranked[min(SKIP_COMMON, len(ranked) // 2):][:VOCABULARY]))


def load_haystack(path=None, chars: int = POOL_CHARS) -> Haystack:
    """The first `chars` characters of prose under `path` (whitespace collapsed), cut into sentences; a
    Haystack passes as it is."""
    if isinstance(path, Haystack):
        return path
    docs, total = [], 0
    for doc in read_documents([haystack_dir(path)]):
        docs.append(" ".join(doc.split()))
        total += len(docs[-1])
        if total >= chars:
            break
    text = " ".join(docs)
    sentences, words = tuple(s for s in _SENTENCE_END.split(text) if s), vocabulary(text)
    if len(words) < MIN_WORDS:
        raise UserError(f"the haystack text under {path or 'the default folder'} has {len(words)} distinct words "
                        f"of 4-10 letters; give a folder with more prose (at least {MIN_WORDS})")
    return Haystack(sentences, words)


# ---------------------------------------------------------------- samples

@dataclass(frozen=True)
class Sample:
    """One prompt and its references; `span` is where the haystack lies in the prompt, `depths` (% of the
    haystack's sentences) where each of `needles` went."""
    prompt: str
    outputs: tuple[str, ...]
    span: tuple[int, int]
    needles: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()
    task: str = ""
    context: int = 0
    index: int = 0

    @property
    def haystack(self) -> str:
        return self.prompt[self.span[0]:self.span[1]]


def _sample(prompt: str, outputs, haystack: str, after: int = 0, **fields) -> Sample:
    start = prompt.index(haystack, after)
    return Sample(prompt, tuple(outputs), (start, start + len(haystack)), **fields)


@dataclass(frozen=True, eq=False)
class Env:
    """What a task builds from besides its seed: the prose, the context length and the prompt's tokenizer."""
    pool: Haystack
    context: int
    encode: Callable[[str], list]

    def count(self, text: str) -> int:
        return len(self.encode(text))


def _draw(rng: random.Random, kind: str, words: Sequence[str]) -> str:
    if kind == "words":
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _fresh(rng: random.Random, kind: str, words: Sequence[str], clashes: Callable[[str], bool]) -> str:
    """A drawn key/value for which `clashes` is false."""
    for _ in range(MAX_DRAWS):
        candidate = _draw(rng, kind, words)
        if not clashes(candidate):
            return candidate
    raise UserError(f"could not draw a {kind[:-1]} absent from the haystack in {MAX_DRAWS} tries: "
                    f"give more varied text")


def _overlaps(candidate: str, taken: Sequence[str]) -> bool:
    return any(candidate in t or t in candidate for t in taken)


def insert_at_depths(sentences: list[str], needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """The sentences with each needle put before sentence ⌊n·depth/100⌋ (n = len(sentences))."""
    out, n = list(sentences), len(sentences)
    for needle, depth in sorted(zip(needles, depths), key=lambda p: -p[1]):
        out.insert(int(n * depth / 100), needle)
    return out


@dataclass(frozen=True)
class Niah:
    """Needle(s) in a haystack: `keys` needles of `values` values each, `queries` keys asked."""
    haystack: str                 # noise | prose | needle
    key: str                      # words | numbers | uuids
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1
    depths: tuple[float, ...] | None = None   # fixed needle depths (the grid); None: drawn from DEPTHS
    max_new_tokens: int = 128
    metric: str = "all"

    def size_range(self, env: Env) -> tuple[int, int]:
        return 1, env.context

    def build(self, key: str, size: int, env: Env) -> Sample:
        rng, words = random.Random(key), env.pool.words
        start = rng.randrange(len(env.pool.sentences))
        filler = ([NOISE] * size if self.haystack == "noise" else
                  env.pool.window(start, size) if self.haystack == "prose" else [])   # needle: drawn below
        joiner = " " if self.haystack == "prose" else "\n"
        reals = self._real_needles(rng, words, joiner.join(filler))
        if self.haystack == "needle":     # distractors: other keys' values, none overlapping a real key or value
            taken = [s for k, vs in reals for s in (k, *vs)]
            filler = [self._needle(_fresh(rng, self.key, words, lambda c: _overlaps(c, taken)),
                                   _fresh(rng, self.value, words, lambda c: _overlaps(c, taken))) for _ in range(size)]
        needles = [self._needle(k, v) for k, vs in reals for v in vs]
        rng.shuffle(needles)
        depths = self.depths or rng.sample(DEPTHS, len(needles))
        asked = rng.sample(range(len(reals)), self.queries)
        haystack = joiner.join(insert_at_depths(filler, needles, depths))
        return _sample(self._prompt(haystack, [reals[i][0] for i in asked]), [v for i in asked for v in reals[i][1]],
                       haystack, needles=tuple(needles), depths=tuple(float(d) for d in depths))

    def _real_needles(self, rng: random.Random, words, text: str) -> list[tuple[str, list[str]]]:
        """[(key, its values)], each absent from `text` and overlapping no other."""
        taken: list[str] = []

        def fresh(kind: str) -> str:
            taken.append(_fresh(rng, kind, words, lambda c: c in text or _overlaps(c, taken)))
            return taken[-1]

        return [(fresh(self.key), [fresh(self.value) for _ in range(self.values)])
                for _ in range(max(self.keys, self.queries))]

    def _needle(self, key: str, value: str) -> str:
        return NEEDLE.format(type_needle_v=self.value, key=key, value=value)

    def _prompt(self, haystack: str, asked: Sequence[str]) -> str:
        """RULER's template and answer prefix, made singular when one value is asked."""
        template, answer, type_v = NIAH_TEMPLATE, NIAH_ANSWER, self.value
        if self.queries * self.values == 1:
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, answer = template.replace(old, new), answer.replace(old, new)
            type_v = type_v[:-1]
        query = ", ".join(asked[:-1]) + ", and " + asked[-1] if len(asked) > 1 else asked[0]
        return (template + answer).format(type_needle_v=type_v, context=haystack, query=query)


@dataclass(frozen=True)
class VariableTracking:
    """Chains VAR X = 12345, VAR Y = VAR X … in repeated noise; the answer is every name of the first chain."""
    chains: int = 1
    hops: int = 4
    max_new_tokens: int = 30
    metric: str = "all"
    example_tokens: int = 500

    def size_range(self, env: Env) -> tuple[int, int]:
        return self.hops + 1, env.context

    def build(self, key: str, size: int, env: Env) -> Sample:
        example = self._example(key, env)
        prompt, names, haystack = self._prompt(random.Random(key), size, letters=5)
        return _sample(example + prompt, names, haystack, after=len(example))

    def _example(self, key: str, env: Env) -> str:
        """The solved in-context example RULER puts first (3-letter names, ≤ min(500, context/4) tokens)."""
        def solved(n: int) -> Sample:
            prompt, names, haystack = self._prompt(random.Random(key + "/example"), n, letters=3)
            return _sample(prompt + " " + " ".join(names) + "\n\n", names, haystack)

        budget = min(self.example_tokens, env.context // 4) - self.max_new_tokens
        example = largest_fitting(solved, env.count, budget, self.hops + 1, env.context)
        return example[0].prompt if example else ""

    def _prompt(self, rng: random.Random, size: int, letters: int) -> tuple[str, list[str], str]:
        """(prompt, the first chain's names, haystack) with `size` noise paragraphs."""
        names: list[str] = []
        while len(names) < self.chains * (self.hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=letters))
            names += [name] if name not in names else []
        sentences = [NOISE + "\n"] * size
        chains = [names[i:i + self.hops + 1] for i in range(0, len(names), self.hops + 1)]
        values = [rng.randint(10000, 99998) for _ in chains]
        for chain, value in zip(chains, values):
            statements = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(chain, chain[1:])]
            positions = sorted(rng.sample(range(len(sentences)), len(statements)))
            for j, (pos, statement) in enumerate(zip(positions, statements)):
                sentences.insert(pos + j, statement)
        haystack = " ".join(sentences).replace(". \n", ".\n")
        prompt = (VT_TEMPLATE + VT_ANSWER).format(context=haystack, query=values[0], num_v=self.hops + 1)
        return prompt.rstrip(), chains[0], haystack


@dataclass(frozen=True)
class CommonWords:
    """A numbered list where `num_cw` words repeat most; RULER's frequencies depend on the context length."""
    num_cw: int = 10
    max_new_tokens: int = 120
    metric: str = "all"

    def size_range(self, env: Env) -> tuple[int, int]:
        return self.num_cw + 1, len(env.pool.words)

    def build(self, key: str, size: int, env: Env) -> Sample:
        rng = random.Random(key)
        short = env.context < 4096
        example, example_answer = self._words(rng, env.pool.words, *((20, 3, 1) if short else (40, 10, 3)))
        words, answer = self._words(rng, env.pool.words, *((size, 6, 1) if short else (size, 30, 3)))
        solved = CWE_TEMPLATE.format(context=example) + CWE_ANSWER + _numbered(example_answer)
        prompt = solved + "\n" + CWE_TEMPLATE.format(context=words) + CWE_ANSWER
        return _sample(prompt, answer, words, after=len(solved))

    def _words(self, rng, vocabulary, n: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        chosen = rng.sample(vocabulary, min(n, len(vocabulary)))
        listed = chosen[:self.num_cw] * common + chosen[self.num_cw:] * uncommon
        rng.shuffle(listed)
        return _numbered(listed), chosen[:self.num_cw]


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann ζ(alpha) for alpha > 1 (partial sum + Euler–Maclaurin tail)."""
    return sum(k ** -alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2


@dataclass(frozen=True)
class FrequentWords:
    """Coded 6-letter words with Zipf counts size·k^−α/ζ(α); rank 1 is '...' (noise), ranks 2–4 the answer."""
    alpha: float = 2.0
    word_length: int = 6
    max_new_tokens: int = 50
    metric: str = "all"

    def size_range(self, env: Env) -> tuple[int, int]:
        return 100, env.context

    def build(self, key: str, size: int, env: Env) -> Sample:
        rng = random.Random(key)
        vocab: set[str] = set()
        while len(vocab) < max(env.context // 50, 5):
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."
        z = zeta(self.alpha)
        coded = [w for k, w in enumerate(ranked, 1) for _ in range(int(size * k ** -self.alpha / z))]
        rng.shuffle(coded)
        text = " ".join(coded)
        return _sample(FWE_TEMPLATE.format(context=text) + FWE_ANSWER, ranked[1:4], text)


TASKS = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("prose", "words", "numbers"),
    "niah_single_3": Niah("prose", "words", "uuids"),
    "niah_multikey_1": Niah("prose", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("prose", "words", "numbers", values=4),
    "niah_multiquery": Niah("prose", "words", "numbers", queries=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}


def largest_fitting(build: Callable[[int], Sample], count: Callable[[str], int], budget: int, lo: int, hi: int,
                    start: int | None = None) -> tuple[Sample, int] | None:
    """(sample, n) for the largest size n in [lo, hi] whose prompt has at most `budget` tokens; None if even lo
    is too long. With `start` (the size of an earlier sample), walk down from it in 2 % steps as RULER does;
    else double from lo, then bisect."""
    built: dict[int, Sample] = {}

    def fits(n: int) -> bool:
        built[n] = built.get(n) or build(n)
        return count(built[n].prompt) <= budget

    if start is not None:
        n = min(start, hi)
        while n > lo and not fits(n):
            n = max(lo, n - max(1, n // 50))
        return (built[n], n) if fits(n) else None
    if not fits(lo):
        return None
    while lo < hi and fits(min(2 * lo, hi)):
        lo = min(2 * lo, hi)
    hi = min(2 * lo, hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return built[lo], lo


class Job(NamedTuple):
    """`samples` prompts of one task at one context length; sample i draws from f"{key}/{i}"."""
    name: str
    spec: object
    context: int
    key: str


def make_samples(job: Job, samples: int, env: Env) -> list[Sample]:
    """The job's samples, each the largest that fits the context with the task's generation budget."""
    out, hint = [], None
    for i in range(samples):
        lo, hi = job.spec.size_range(env)
        fitted = largest_fitting(lambda n: job.spec.build(f"{job.key}/{i}", n, env), env.count,
                                 job.context - job.spec.max_new_tokens, lo, hi, start=hint)
        if fitted is None:
            raise UserError(f"context {job.context} is too short for {job.name} (its prompt and "
                            f"{job.spec.max_new_tokens} generated tokens do not fit): use a longer --context")
        out.append(replace(fitted[0], task=job.name, context=job.context, index=i))
        hint = fitted[1] if hint is None else hint
    return out


# ---------------------------------------------------------------- generation

class AnswerFound(StoppingCriteria):
    """Stops a row once its answer scores 1: more text cannot lower a string-match score."""

    def __init__(self, tokenizer, prompt_len: int, references: Sequence[Sequence[str]], metric: str):
        self.tokenizer, self.prompt_len, self.references, self.metric = tokenizer, prompt_len, references, metric

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([score_of(t, refs, self.metric) == 1.0 for t, refs in zip(texts, self.references)],
                            device=input_ids.device)


def left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, max length], padded on the left."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids, mask


@torch.inference_mode()
def generate_answers(model, tokenizer, samples: Sequence[Sample], spec, kv_bits: int | None = None) -> list[str]:
    """Greedy answers to one batch of prompts (LatentCache for MLA models; `kv_bits` 4/2 quantizes it)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids, mask = left_padded([tokenizer(s.prompt)["input_ids"] for s in samples], pad)
    stop = AnswerFound(tokenizer, ids.shape[1], [s.outputs for s in samples], spec.metric)
    cache = {CACHE_NAME: LatentCache(model.config, kv_bits=kv_bits)} if kv_bits is not None else {}
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=spec.max_new_tokens, pad_token_id=pad,
                         stopping_criteria=StoppingCriteriaList([stop]), **cache)
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


def batches(samples: Sequence[Sample], specs: dict, batch_tokens: int) -> list[list[Sample]]:
    """Samples that generate alike (one context length, generation budget and metric) in batches of up to
    batch_tokens // context prompts: shortest context first, so a run stopped early has finished its short
    rows; within a length in order of first appearance."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.context, specs[s.task].max_new_tokens, specs[s.task].metric), []).append(s)
    ordered = sorted(groups.items(), key=lambda item: item[0][0])
    return [group[b:b + max(1, batch_tokens // context)] for (context, _, _), group in ordered
            for b in range(0, len(group), max(1, batch_tokens // context))]


def run_jobs(model, tokenizer, jobs: Sequence[Job], samples: int, pool: Haystack, kv_bits: int | None,
             log: ScoreLog | None = None, batch_tokens: int = BATCH_TOKENS) -> dict[tuple[str, int], float]:
    """{(job name, context): mean score}. Every prompt is built (and checked) before the first is generated;
    samples `log` holds are not generated again, and each new score goes to it as its batch finishes."""
    def encode(text: str) -> list[int]:   # as generate_answers tokenizes
        return tokenizer(text)["input_ids"]

    def key(s: Sample) -> tuple[str, int, int]:
        return s.task, s.context, s.index

    specs = {job.name: job.spec for job in jobs}
    prepared = [s for job in jobs for s in make_samples(job, samples, Env(pool, job.context, encode))]
    done = log.done if log is not None else {}
    scores = {key(s): done[key(s)] for s in prepared if key(s) in done}
    with tqdm(total=len(prepared), initial=len(scores), desc="long-context samples", unit="sample",
              file=sys.stderr) as bar:
        for batch in batches([s for s in prepared if key(s) not in done], specs, batch_tokens):
            answers = generate_answers(model, tokenizer, batch, specs[batch[0].task], kv_bits)
            for answer, s in zip(answers, batch):
                scores[key(s)] = score_of(answer, s.outputs, specs[s.task].metric)
                if log is not None:
                    log.add(key(s), scores[key(s)])
            bar.update(len(batch))
            bar.set_postfix_str(f"{batch[-1].task} @ {batch[-1].context}")
    got: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for (task, context, _), score in scores.items():
        got[(task, context)].append(score)
    return {key: sum(values) / len(values) for key, values in got.items()}


# ---------------------------------------------------------------- checks and entry points

def check_tasks(tasks: str | Sequence[str]) -> list[str]:
    tasks = [t for t in tasks.split(",") if t] if isinstance(tasks, str) else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UserError(f"unknown task {', '.join(unknown) or '(none given)'}: RULER tasks are {', '.join(TASKS)}")
    return tasks


def check_contexts(contexts: Sequence[int]) -> list[int]:
    if not contexts or any(c < 1 for c in contexts):
        raise UserError(f"give positive context lengths in tokens, e.g. 1024,2048,4096 (got {list(contexts)})")
    return list(contexts)


def check_samples(samples: int) -> None:
    if samples < 1:
        raise UserError(f"--samples must be ≥ 1 (got {samples})")


def check_depths(depths: Sequence[float]) -> list[float]:
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad or not depths:
        raise UserError(f"depths are percentages in [0, 100] (got {', '.join(f'{d:g}' for d in bad) or 'none'})")
    return list(depths)


def _loaded(model_or_path, contexts: Sequence[int], kv_bits: int | None, dtype):
    """(model, tokenizer), checked: `kv_bits` needs an MLA model and the longest context must fit its positions."""
    model, tokenizer = as_model(model_or_path, dtype)
    check_kv_bits(kv_bits, model)
    check_fits_context(model, max(contexts), f"--context {max(contexts)}")
    return model, tokenizer


def score_log(path, evaluation: str, model_or_path, seed: int, kv_bits, haystack, dtype) -> ScoreLog | None:
    """The resumable record of a run (None without a path): named by what its scores depend on."""
    if path is None:
        return None
    source = "in memory" if isinstance(haystack, Haystack) else str(haystack_dir(haystack))
    return ScoreLog(path, {"evaluation": evaluation, "model": model_name(model_or_path), "seed": seed,
                           "kv_bits": kv_bits, "haystack": source, "dtype": None if dtype is None else str(dtype)})


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def evaluate_ruler(model_or_path, contexts: Sequence[int] = CONTEXTS, tasks: str | Sequence[str] = tuple(TASKS),
                   samples: int = SAMPLES, seed: int = 0, kv_bits: int | None = None, haystack=None,
                   dtype=None, resume=None) -> dict:
    """RULER scores per task and context length, and their average per length (fractions in [0, 1]).
    `resume`: a file of scored samples (score_log.py) that a killed run continues from.

    Returns {"model", "tasks", "contexts", "samples", "seed", "kv_bits", "results": {task: {"<context>":
    score}}, "average": {"<context>": score}, "seconds"}. `model_or_path` as in `evaluate_tasks`.
    """
    contexts, tasks = check_contexts(contexts), check_tasks(tasks)
    check_samples(samples)
    check_kv_bits(kv_bits)
    pool, start = load_haystack(haystack), time.perf_counter()
    model, tokenizer = _loaded(model_or_path, contexts, kv_bits, dtype)
    jobs = [Job(task, TASKS[task], c, f"{seed}/{task}") for task in tasks for c in contexts]
    log = score_log(resume, "ruler", model_or_path, seed, kv_bits, haystack, dtype)
    scores = run_jobs(model, tokenizer, jobs, samples, pool, kv_bits, log)
    results = {task: {str(c): scores[(task, c)] for c in contexts} for task in tasks}
    return {"model": model_name(model_or_path), "tasks": tasks, "contexts": contexts, "samples": samples,
            "seed": seed, "kv_bits": kv_bits, "results": results,
            "average": {str(c): _mean(results[t][str(c)] for t in tasks) for c in contexts},
            "seconds": time.perf_counter() - start}


def niah_grid(model_or_path, contexts: Sequence[int] = CONTEXTS, depths: Sequence[float] = (0, 25, 50, 75, 100),
              samples: int = 5, seed: int = 0, kv_bits: int | None = None, haystack=None, dtype=None,
              resume=None) -> dict:
    """The needle-in-a-haystack map: niah_single_2 (a word's 7-digit number in prose) with the needle at each
    depth (% of the haystack) and context length; each sample keeps its needle and text across the grid.

    Returns {"model", "task", "contexts", "depths", "samples", "seed", "kv_bits", "results": {"<context>":
    {"<depth>": score}}, "average": {"<context>": score}, "seconds"}.
    """
    contexts, depths = check_contexts(contexts), check_depths(depths)
    check_samples(samples)
    check_kv_bits(kv_bits)
    pool, start = load_haystack(haystack), time.perf_counter()
    model, tokenizer = _loaded(model_or_path, contexts, kv_bits, dtype)
    jobs = [Job(f"{d:g}", replace(TASKS[NIAH_GRID_TASK], depths=(d,)), c, f"{seed}/niah")
            for c in contexts for d in depths]
    log = score_log(resume, "niah", model_or_path, seed, kv_bits, haystack, dtype)
    scores = run_jobs(model, tokenizer, jobs, samples, pool, kv_bits, log)
    results = {str(c): {f"{d:g}": scores[(f"{d:g}", c)] for d in depths} for c in contexts}
    return {"model": model_name(model_or_path), "task": NIAH_GRID_TASK, "contexts": contexts, "depths": depths,
            "samples": samples, "seed": seed, "kv_bits": kv_bits, "results": results,
            "average": {c: _mean(row.values()) for c, row in results.items()},
            "seconds": time.perf_counter() - start}


def ruler_suite(contexts: Sequence[int] = CONTEXTS, tasks: str | Sequence[str] = tuple(TASKS),
                samples: int | None = None, seed: int = 0, haystack=None) -> Callable:
    """The `ruler` group of `compare_models`: checks its arguments now and returns pair → {"results":
    {"ruler@<context>": {"acc": average, "acc_norm": None, "n"}}, "average", "ruler": evaluate_ruler's result}."""
    contexts, tasks, samples = check_contexts(contexts), check_tasks(tasks), samples or SAMPLES
    check_samples(samples)
    pool = load_haystack(haystack)

    def suite(pair) -> dict:
        result = evaluate_ruler(pair, contexts, tasks, samples, seed, haystack=pool)
        columns = {f"ruler@{c}": {"acc": result["average"][str(c)], "acc_norm": None, "n": samples * len(tasks)}
                   for c in contexts}
        return {"results": columns, "average": _mean(result["average"].values()), "ruler": result}

    return suite


# ---------------------------------------------------------------- tables

def grid_table(rows: dict[str, dict[str, float]], corner: str, footer: dict[str, float] | None = None) -> str:
    """A markdown table of scores in %: one row per key of `rows`, one column per key of its values."""
    columns = list(next(iter(rows.values())))
    lines = ["| " + " | ".join([corner, *columns]) + " |", "|" + "|".join(["---"] + ["---:"] * len(columns)) + "|"]
    for name, row in list(rows.items()) + ([("**average**", footer)] if footer else []):
        lines.append("| " + " | ".join([name, *(f"{100 * row[c]:.1f}" for c in columns)]) + " |")
    return "\n".join(lines)


def ruler_table(result: dict) -> str:
    """Task × context length (%), with the average per length."""
    return grid_table(result["results"], "task \\ context", result["average"])


def niah_table(result: dict) -> str:
    """Depth (%) × context length (%), with the average per length."""
    by_depth = {f"{d}": {c: result["results"][c][d] for c in result["results"]}
                for d in next(iter(result["results"].values()))}
    return grid_table(by_depth, "depth % \\ context", result["average"])
