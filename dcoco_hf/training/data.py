"""Training data for a drafter: the target's own greedy answers, stored with a response mask.

DFlash and DCOCO train on the target's OWN greedy responses, so the drafter learns to predict what the target will
accept. `prompt_sources` builds the prompts at scale; this module adds the ones the target writes itself
("self-instruct", kept batch by batch in a `ReplyJournal` so a killed run resumes):

* chat prompts: the target is asked, with sampling, for a question a user might ask about one of a fixed list of
  everyday topics;
* programming exercises: asked for the signature and docstring of a small function about a programming topic, the
  first such function of its reply becomes a "complete the function" prompt (closer to HumanEval's small algorithmic
  tasks than library functions are; functions named as in HumanEval are dropped).

`regenerate` has the target answer prompts shortest first, in batches, and writes shards (`shard-00000.safetensors`:
records of {"input_ids", "loss_mask"}, a format that runs no code when loaded; older folders' `shard-*.pt` are read
with `weights_only=True`), so answering resumes where it stopped and training streams shards.
`cache_target_features` stores the target's hidden states per shard, once, for the training stages.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..runtime.hf_compat import cache_kwargs
from ..runtime.logs import log
from ..runtime.prompts import (
    HUMANEVAL_TEMPLATE,
    chat_input_ids,
    eos_token_ids,
    left_pad,
    padding_id,
    prompt_input_ids,
)
from ..runtime.target_cache import static_target_cache

CHAT_TOPICS = (
    "cooking", "travel", "personal finance", "history", "physics", "biology", "chemistry", "geography", "music",
    "film", "literature", "poetry", "sports", "fitness", "nutrition", "sleep", "productivity", "careers",
    "job interviews", "writing emails", "grammar", "learning languages", "mathematics", "statistics", "economics",
    "philosophy", "ethics", "psychology", "parenting", "pets", "gardening", "home repair", "cars", "cycling",
    "astronomy", "weather", "climate", "energy", "computers", "the internet", "smartphones", "video games",
    "board games", "art", "photography", "fashion", "architecture", "law", "politics", "public speaking",
    "negotiation", "friendship", "relationships", "mental health", "meditation", "time management", "budgeting",
    "investing", "small business", "marketing", "customer service", "education", "studying for exams",
    "science fiction", "mythology", "religion", "languages of the world", "oceans", "mountains", "animals", "insects",
    "space exploration", "inventions", "famous scientists", "ancient Rome", "ancient Egypt", "the Middle Ages",
    "renewable energy", "recycling", "first aid", "camping", "baking", "coffee", "tea", "wine", "birthdays",
    "holidays", "writing a story", "role-playing a character", "summarizing an article", "brainstorming names",
    "explaining a concept to a child", "comparing two products", "planning a trip", "writing a cover letter",
    "debugging Python code", "SQL queries", "algorithms", "data structures", "web development", "command line tools",
)

EXERCISE_TOPICS = (
    "strings", "lists of numbers", "prime numbers", "palindromes", "sorting", "dictionaries", "vowels", "matrices",
    "digits of a number", "counting characters", "sums and products", "even and odd numbers", "maximum and minimum",
    "averages", "Fibonacci numbers", "factorials", "binary numbers", "anagrams", "words in a sentence",
    "removing duplicates", "sets", "tuples", "intervals", "geometry", "temperatures", "student grades",
    "shopping carts", "bank accounts", "string formatting", "recursion", "greatest common divisors", "powers",
    "roman numerals", "a Caesar cipher", "run-length encoding", "balanced brackets", "stacks", "queues",
    "searching a list", "nested lists", "dates and times", "uppercase and lowercase letters", "substrings",
    "splitting and joining strings", "counting words", "frequencies", "cumulative sums", "rotating a list",
    "merging lists", "pairs of numbers", "triangles", "circles and areas", "unit conversion", "leap years",
    "time durations", "prices and discounts", "scores of a game", "grids", "coordinates", "distances",
    "sequences", "number patterns", "divisibility", "rounding numbers", "parsing numbers from text",
    "validating input", "passwords", "email addresses", "file names", "hexadecimal numbers", "bits",
    "reversing things", "filtering a list", "mapping values", "grouping items", "ranking items", "histograms",
)
_EXERCISE = re.compile(  # a one-line top-level def, then at once its docstring (either quote style, any lines)
    r'^(?P<signature>def (?P<name>\w+)\([^\n]*\)(?:[ \t]*->[^:\n]+)?:)[ \t]*\n'
    r'[ \t]+(?P<q>"""|\'\'\')(?P<doc>.+?)(?P=q)',
    re.M | re.S,
)

# Records per shard: what a killed run loses at most, and the unit answering and feature caching resume by.
RECORDS_PER_SHARD = 64


@torch.no_grad()
def _sampled_replies(
    target, tokenizer, asks: list[str], max_new_tokens: int, temperature: float, batch_size: int
) -> Iterator[str]:
    """The target's sampled reply (top-p 0.95) to each ask, in order."""
    for batch in _batches(asks, batch_size):
        ids, mask = left_pad([chat_input_ids(tokenizer, a)[0] for a in batch], padding_id(tokenizer))
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
            top_p=0.95,
        )
        yield from tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def self_instruct_prompts(
    target, tokenizer, count: int, seed: int = 0, batch_size: int = 32, journal: str | Path | None = None
) -> list[str]:
    """`count` user questions written by the target itself, each about a topic from CHAT_TOPICS (sampled, T=0.9).
    With `journal`, the replies are kept there batch by batch and a rerun reuses them (`ReplyJournal`)."""
    rng = random.Random(seed)
    asks = [
        f"Write one question that a user might ask an AI assistant about {rng.choice(CHAT_TOPICS)}. "
        "Reply with the question only."
        for _ in range(count)
    ]
    kept = ReplyJournal(journal)
    questions = []
    progress = tqdm(total=len(asks), desc="questions", unit="ask")
    for index, batch in enumerate(_batches(asks, batch_size)):
        for reply in kept.replies(index, seed, lambda: _sampled_replies(target, tokenizer, batch, 48, 0.9, batch_size)):
            question = reply.strip().split("\n")[0].strip().strip('"')
            if len(question) > 15:
                questions.append(question)
        progress.update(len(batch))
    progress.close()
    return questions


class ReplyJournal:
    """The target's sampled replies, one JSON line per batch of asks, so that a killed prompt phase keeps what it
    wrote. Each batch samples under its own seed (`seed`, batch index), so a resumed run writes what an uninterrupted
    one would have; without a path nothing is kept."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self.done: dict[int, list[str]] = {}
        if self.path is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            for line in lines:
                try:
                    entry = json.loads(line)
                except ValueError:  # the last line of a killed run, cut short
                    continue
                self.done[entry["batch"]] = entry["replies"]
            # rewritten without the cut line, so that the next line appended does not join it
            self.path.write_text("".join(json.dumps({"batch": k, "replies": v}) + "\n" for k, v in self.done.items()))

    def replies(self, index: int, seed: int, sample: Callable[[], Iterable[str]]) -> list[str]:
        if index in self.done:
            return self.done[index]
        torch.manual_seed(seed * 1_000_003 + index)
        replies = list(sample())
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps({"batch": index, "replies": replies}) + "\n")
        self.done[index] = replies
        return replies


def exercise_prompt(reply: str) -> tuple[str, str] | None:
    """(function name, "complete the function" prompt) from the first top-level function with a docstring of at
    least 20 characters in a reply; None when there is none. Whatever body the reply wrote is dropped."""
    for match in _EXERCISE.finditer(reply):
        doc = inspect.cleandoc(match["doc"])
        if len(doc) >= 20:
            docstring = textwrap.indent(doc, "    ", lambda line: line.strip() != "").lstrip()
            stub = f'{match["signature"]}\n    """{docstring}\n    """\n'
            return match["name"], HUMANEVAL_TEMPLATE.format(prompt=stub)
    return None


SATURATED_BATCHES, SATURATED_SHARE = 4, 0.25


def self_instruct_exercises(
    target,
    tokenizer,
    count: int,
    seed: int = 0,
    batch_size: int = 32,
    max_asks: int | None = None,
    *,
    exclude: Iterable[str],
    journal: str | Path | None = None,
) -> list[str]:
    """Up to `count` "complete the function" prompts for programming exercises the target writes itself.

    The target is asked (sampled, T=0.8) for the signature and docstring of a short function about a topic from
    EXERCISE_TOPICS; `exercise_prompt` turns the first function of each reply into a prompt. Functions named as one
    of the prompts in `exclude` are dropped, and so are repeated names. `exclude` has no default because it is what
    keeps the evaluation held out: pass the HumanEval prompts (`dcoco_hf.assets.humaneval_prompts()`, fetched by the
    caller so that training never downloads), so a HumanEval function's name (its `is_prime`, say) is never asked
    for even in spirit, plus an earlier folder's prompts (a second folder then adds new functions, not new
    docstrings for old ones). Asks go on in batches until `count` prompts are found, `max_asks` (default
    3 x count) asks are spent, or the target has run out of new functions: the last `SATURATED_BATCHES` batches each
    found new ones for fewer than `SATURATED_SHARE` of their asks (a sampled target repeats its favourite names more
    and more often; past that point a batch costs as much target time as its asks in answers, for a few prompts).
    With `journal`, the replies are kept there batch by batch (`ReplyJournal`).
    """
    held_out = {m for p in exclude for m in re.findall(r"def (\w+)\(", p)}
    rng = random.Random(seed)
    kept = ReplyJournal(journal)
    prompts: dict[str, str] = {}  # function name -> prompt
    found_per_batch: list[int] = []
    progress = tqdm(total=count, desc="exercises", unit="prompt")
    for index in range(len(range(0, max_asks or 3 * count, batch_size))):
        asks = [
            f"Write a short Python programming exercise about {rng.choice(EXERCISE_TOPICS)}: only the function "
            "signature and a docstring that explains the task with an example. Do not write the solution."
            for _ in range(batch_size)
        ]
        before = len(prompts)
        for reply in kept.replies(index, seed, lambda: _sampled_replies(target, tokenizer, asks, 128, 0.8, batch_size)):
            found = exercise_prompt(reply)
            if found is not None and found[0] not in held_out and found[0] not in prompts:
                prompts[found[0]] = found[1]
        found_per_batch.append(len(prompts) - before)
        progress.update(min(len(prompts), count) - progress.n)
        recent = found_per_batch[-SATURATED_BATCHES:]
        if len(prompts) >= count or (
                len(recent) == SATURATED_BATCHES and max(recent) < SATURATED_SHARE * batch_size):
            break
    progress.close()
    return list(prompts.values())[:count]


@torch.no_grad()
def regenerate(
    target,
    tokenizer,
    prompts: list[str],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    shard_size: int = RECORDS_PER_SHARD,
    max_shards: int | None = None,
    deadline: float | None = None,
    max_prompt_tokens: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> Path:
    """Answer every prompt with the target (greedy, chat template) and store token ids + response mask in shards.

    Prompts are answered shortest first (`prompts.json` in `out_dir` records that order), so the rows of a batch pad
    to about the same length: unsorted, the longest prompt of a batch of 64 was 2.6 times the batch's mean on
    SmolLM2's training prompts, and every row paid for it at every step. Resumable: shards already on disk are
    skipped, and `max_shards` (or `deadline`, a `time.time()` after which no new shard starts; each call writes at
    least one) stops early; a later call goes on with the same prompts, and refuses a folder whose shards answered
    other prompts. Prompts of more than `max_prompt_tokens` tokens are left out (`left_out.json` lists them): their
    answers would not fit the records training reads, and one such prompt pads every row of its batch to its length,
    which can exhaust memory. `part` (rank, processes): this process answers the shards whose index % processes ==
    rank, and only rank 0 writes the prompt lists. The progress bar counts answers and the tokens/s they are written
    at.
    """
    rank, processes = part
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoded = [prompt_input_ids(tokenizer, p)[0] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # stable: ties keep their order
    fits = [max_prompt_tokens is None or len(ids) <= max_prompt_tokens for ids in encoded]
    kept, left_out = [i for i in order if fits[i]], [prompts[i] for i in order if not fits[i]]
    prompts, encoded = [prompts[i] for i in kept], [encoded[i] for i in kept]
    shards = list(_batches(encoded, shard_size))[:max_shards]
    done = [shard_done(out_dir, index) for index in range(len(shards))]
    answered = out_dir / "prompts.json"
    if answered.exists() and any(done):
        # Only the prompts of the shards already written must be the same (a later shard may be new).
        before = json.loads(answered.read_text())
        written = [i * shard_size + j for i, d in enumerate(done) if d for j in range(len(shards[i]))]
        if any(i >= len(before) or before[i] != prompts[i] for i in written):
            raise ValueError(f"{out_dir} holds answers to other prompts, or to these in another order; delete its "
                             "shard-* files (or answer into another folder) to answer these")
    if rank == 0:
        write_json(answered, prompts)
        if left_out:
            write_json(out_dir / "left_out.json", left_out)
            log(f"{len(left_out)} prompt(s) of more than {max_prompt_tokens} tokens left out (listed in "
                f"{out_dir / 'left_out.json'}): their answers would not fit the records training reads")
    rules = logit_rules(target)
    if rules and rank == 0:
        log(f"the target's generation config sets {', '.join(rules)}: the answers are the target's plain greedy "
            "argmax without them, so the drafter learns to draft that (outputs stay exact either way)")
    mine = [index % processes == rank for index in range(len(shards))]
    progress = tqdm(total=sum(len(s) for s, m in zip(shards, mine) if m),
                    initial=sum(len(s) for s, d, m in zip(shards, done, mine) if d and m), desc="answers",
                    unit="answer")
    start, tokens = time.time(), 0
    for index, shard in enumerate(shards):
        if done[index] or not mine[index]:
            continue
        records = []
        for batch in _batches(shard, batch_size):
            ids, mask = left_pad(batch, padding_id(tokenizer))
            answers = greedy_answers(target, ids.to(target.device), mask.to(target.device), max_new_tokens)
            for prompt, response in zip(batch, answers):
                records.append(_record(prompt, response))
                tokens += len(response)
            progress.update(len(batch))
            progress.set_postfix_str(f"{tokens / max(time.time() - start, 1e-9):.1f} tokens/s")
        save_shard(records, shard_path(out_dir, index))
        if deadline is not None and time.time() >= deadline:  # checked after a shard: each call adds at least one
            break
    progress.close()
    return out_dir


# Generation-config fields with which generate(do_sample=False) changes the logits before its argmax.
LOGIT_RULES = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
               "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "min_length", "min_new_tokens",
               "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty")


def logit_rules(target) -> list[str]:
    """The `LOGIT_RULES` the target's generation config sets away from their defaults: `greedy_answers` writes the
    plain argmax, which these would change."""
    defaults = GenerationConfig()
    return [name for name in LOGIT_RULES
            if getattr(target.generation_config, name, None) != getattr(defaults, name, None)]


@torch.no_grad()
def greedy_answers(target, input_ids: torch.LongTensor, attention_mask: torch.LongTensor,
                   max_new_tokens: int) -> list[torch.LongTensor]:
    """The target's greedy answer to each left-padded row ([B, L] each), up to and including its first EOS: the
    tokens batched `generate(do_sample=False)` writes for it. Unlike `generate()`, a row whose answer has ended leaves
    the batch (its cache rows are dropped), so the rest of a batch no longer pays for it: the target's answers run
    from a few tokens to the cap, and a forward's cost grows with its rows. The answers are the plain argmax; where
    the generation config adds logit rules (`logit_rules`), `regenerate` says so before answering.

    The keys and values live in buffers sized for the batch's prompts and answers (`static_target_cache`), written in
    place, where a dynamic cache copies every layer's whole cache at every step to append one column (a few percent
    of a step at 64 rows of a few hundred tokens on a 2-core CPU; the same answers)."""
    eos = torch.tensor(eos_token_ids(target.generation_config.eos_token_id), dtype=torch.long,
                       device=input_ids.device)
    # Left padding: a row's positions count its own tokens, as generate() numbers them.
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
    cache = static_target_cache(input_ids.shape[1] + max_new_tokens)
    logits = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1, **cache_kwargs(cache)).logits[:, -1]  # [B, V]
    answers: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)  # [b]: the batch rows still answering
    mask, position = attention_mask, positions[:, -1]
    for step in range(max_new_tokens):
        tokens = logits.argmax(-1)  # [b]
        for row, token in zip(rows.tolist(), tokens.tolist()):
            answers[row].append(token)
        going = (~torch.isin(tokens, eos)).nonzero().squeeze(1)
        if step + 1 == max_new_tokens or going.numel() == 0:
            break
        if going.numel() < rows.numel():
            cache.batch_select_indices(going)
            tokens, mask, position, rows = tokens[going], mask[going], position[going], rows[going]
        mask = torch.cat([mask, mask.new_ones(rows.numel(), 1)], dim=1)
        position = position + 1
        logits = target(input_ids=tokens[:, None], attention_mask=mask, position_ids=position[:, None],
                        use_cache=True, **cache_kwargs(cache)).logits[:, -1]
    return [torch.tensor(answer, dtype=torch.long) for answer in answers]


def write_json(path: Path, value: Any, indent: int | None = None) -> None:
    """Write `value` as JSON all at once (a temporary file renamed): a kill leaves the old file whole, and other
    processes may read it meanwhile."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=indent))
    tmp.rename(path)


SHARD_SUFFIX = ".safetensors"
_LENGTHS = ".lengths"  # beside each field: every record's length along dim 0


def shard_path(folder: str | Path, index: int) -> Path:
    """Where shard `index` of a data folder is written."""
    return Path(folder) / f"shard-{index:05d}{SHARD_SUFFIX}"


def shard_paths(folder: str | Path) -> list[Path]:
    """A data folder's shards in order: safetensors ones, and `.pt` ones of older folders (read with
    `weights_only=True`); where an index has both, the safetensors one."""
    found: dict[str, Path] = {}
    for path in sorted(Path(folder).glob("shard-*.pt")) + sorted(Path(folder).glob(f"shard-*{SHARD_SUFFIX}")):
        found[path.stem] = path
    return [found[stem] for stem in sorted(found)]


def shard_done(folder: str | Path, index: int) -> bool:
    """Whether shard `index` is on disk, in either format."""
    return shard_path(folder, index).exists() or shard_path(folder, index).with_suffix(".pt").exists()


def save_shard(records: list[dict[str, torch.Tensor]], path: str | Path) -> None:
    """Write `records` to `path` atomically as safetensors, a format that runs no code when loaded: per field, the
    records' tensors concatenated along dim 0 and their lengths (`read_shard` splits them back)."""
    names = list(records[0]) if records else []
    tensors = {}
    for name in names:
        tensors[name] = torch.cat([r[name] for r in records]).contiguous()
        tensors[name + _LENGTHS] = torch.tensor([len(r[name]) for r in records], dtype=torch.long)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "dcoco-hf records"})
    tmp.rename(path)


def read_shard(path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The records of one shard: safetensors (`save_shard`), or an older folder's `.pt` list of dicts, loaded with
    `weights_only=True` (tensors and containers only: no code runs)."""
    path = Path(path)
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    tensors = load_file(str(path))
    names = [name for name in tensors if not name.endswith(_LENGTHS)]
    columns = {name: tensors[name].split(tensors[name + _LENGTHS].tolist()) for name in names}
    count = len(next(iter(columns.values()))) if columns else 0
    return [{name: columns[name][row] for name in names} for row in range(count)]


def load_shards(data_dir: str | Path) -> list[dict[str, torch.Tensor]]:
    """All records of a data folder (the answers phase's shards), in shard order."""
    paths = shard_paths(data_dir)
    if not paths:
        raise FileNotFoundError(f"No shard-* files in {data_dir}: write them first with `dcoco-hf train --target "
                                "MODEL --out RUN --until answers` (they land in RUN/data).")
    return [record for path in paths for record in read_shard(path)]


def learned_token_counts(records: list[dict[str, torch.Tensor]], vocab_size: int) -> torch.LongTensor:
    """[V]: how often each token occurs in the records' learned spans (`loss_mask`: what the target wrote)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        counts += torch.bincount(record["input_ids"][record["loss_mask"].bool()].long(), minlength=vocab_size)
    return counts


def draft_vocabulary(
    records: list[dict[str, torch.Tensor]], vocab_size: int, size: int, always: list[int] = ()
) -> tuple[torch.LongTensor, float]:
    """The `size` tokens written most often in the records' learned spans (`loss_mask`), plus `always` (end-of-turn
    ids, which are rare but end every answer); and the share of those spans' tokens the result covers."""
    counts = learned_token_counts(records, vocab_size)
    if counts.sum() == 0:
        raise ValueError("The records have no learned tokens (loss_mask is empty everywhere); pass real training data.")
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[list(always)] = True
    ranked = counts.argsort(descending=True, stable=True)
    ranked = ranked[~keep[ranked]]
    keep[ranked[: max(0, size - int(keep.sum()))]] = True
    return keep.nonzero().squeeze(1), float(counts[keep].sum() / counts.sum())


def _record(prompt: torch.LongTensor, response: torch.LongTensor) -> dict[str, torch.Tensor]:
    input_ids = torch.cat([prompt, response]).to(torch.int32)
    loss_mask = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    loss_mask[prompt.shape[0] :] = True
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def _length_batches(records: list[dict], batch_tokens: int) -> Iterator[list[dict]]:
    """Records grouped by length, each group padding to at most `batch_tokens` positions (a longer record alone)."""
    batch: list[dict] = []
    for record in sorted(records, key=lambda r: len(r["input_ids"])):
        if batch and (len(batch) + 1) * len(record["input_ids"]) > batch_tokens:
            yield batch
            batch = []
        batch.append(record)
    if batch:
        yield batch


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def cache_target_features(
    target,
    layer_ids: list[int],
    data_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    batch_tokens: int = 4096,
    deadline: float | None = None,
    greedy_text: bool = False,
    part: tuple[int, int] = (0, 1),
) -> Path:
    """Precompute the target context of every record (hidden states at `layer_ids`, argmax labels), shard by shard.
    `greedy_text`: the records are the target's own greedy answers (`regenerate`'s), so the labels are their next
    tokens and the forwards stop after the deepest layer read (`target_context`).

    Worth it when training for more than one epoch: one target forward per sequence instead of one per epoch.
    States are stored in bf16 (the drafter's `fc` is robust to it; fp16 overflows there). Records of similar length
    share a right-padded forward of at most `batch_tokens` positions (twice the throughput of one record at a time on
    a 2-core CPU); causal attention keeps padding out of every real position. Resumable; with `deadline` (a
    `time.time()`) no new shard starts after it. `part` (rank, processes): this process caches the shards whose
    index % processes == rank.
    """
    from .objective import target_context

    rank, processes = part
    device = next(target.parameters()).device
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = tqdm(shard_paths(data_dir)[rank::processes], desc="target features", unit="shard")
    tokens, start = 0, time.time()
    for path in progress:
        if deadline is not None and time.time() >= deadline:
            break
        destination = out_dir / (path.stem + SHARD_SUFFIX)
        legacy = destination.with_suffix(".pt")
        if destination.exists() or legacy.exists():
            _check_cached_source(path, destination if destination.exists() else legacy)
            continue
        records = read_shard(path)
        for batch in _length_batches(records, batch_tokens):
            lengths = [len(record["input_ids"]) for record in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, record in enumerate(batch):
                ids[row, : lengths[row]] = record["input_ids"]
                mask[row, : lengths[row]] = 1
            states, argmax = target_context(target, layer_ids, ids.to(device), mask.to(device), greedy_text=greedy_text)
            states, argmax = states.to("cpu", dtype), argmax.cpu()
            for row, record in enumerate(batch):
                record["context_states"] = states[row, : lengths[row]]
                record["target_argmax"] = argmax[row, : lengths[row]].to(torch.int32)
        _fingerprint_file(destination).write_text(_fingerprint(path))
        save_shard(records, destination)
        tokens += sum(len(record["input_ids"]) for record in records)
        progress.set_postfix_str(f"{tokens / max(time.time() - start, 1e-9):.0f} tokens/s")
    return out_dir


def _fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fingerprint_file(cached: Path) -> Path:
    return cached.with_suffix(".source-sha256")


def _check_cached_source(source: Path, cached: Path) -> None:
    """A cached feature shard is reused only for the very data shard it was computed from: a folder regenerated
    under the same name (other prompts, other answers) must not silently train on the old records' features."""
    stamp = _fingerprint_file(cached)
    same = stamp.exists() and stamp.read_text() == _fingerprint(source)
    if not same:  # never stamped, or the shard file was rewritten (e.g. repacked): compare the token ids once
        old, new = read_shard(cached), read_shard(source)
        same = len(old) == len(new) and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(old, new))
        if same:
            stamp.write_text(_fingerprint(source))
    if not same:
        raise ValueError(
            f"{cached} holds target features of other records than {source} (the data folder changed after they "
            f"were cached). Delete {cached.parent} (or pass another --features folder) to cache them again."
        )
