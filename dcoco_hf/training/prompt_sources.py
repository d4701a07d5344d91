"""Prompts at scale for a drafter's training data: tens of thousands of distinct prompts, none overlapping the
evaluation sets, described by a dataset card.

Published DFlash-style recipes agree that the number of target-written answers decides a drafter's acceptance
(1,600 samples: acceptance length 1.81 for Qwen3-0.6B; 100,000: 3.15 for Llama-3.2-1B). Every source here installs
with the package or is written by the target itself (`data.self_instruct_prompts`, `data.self_instruct_exercises`):

* code: "complete the function" prompts from every documented function and public method of the standard library
  and of the pure-Python libraries installed beside it (NumPy, SymPy, NetworkX, Jinja2, ...: what torch and
  transformers bring), in the form of the project's HumanEval prompts (`library_code_prompts`);
* tasks: chat, reasoning, writing and other-language requests, built from task templates over topics and languages,
  and arithmetic word problems whose numbers make each one distinct (`task_prompts`).

`prepare_prompts` deduplicates them (case- and whitespace-blind) and drops every prompt that shares a run of
`OVERLAP_WORDS` words with an evaluation prompt, or names a function an evaluation prompt defines, and reports what
it dropped; `cards.dataset_card` writes that report down.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import random
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .data import CHAT_TOPICS
from ..runtime.prompts import HUMANEVAL_TEMPLATE

# Installed libraries whose documented functions make code prompts, when present. Pure-Python or thin-wrapper
# packages that import cheaply and without side effects; torch and transformers are left out (thousands of
# modules, minutes of imports).
LIBRARIES = ("numpy", "sympy", "networkx", "jinja2", "yaml", "packaging", "tqdm", "filelock", "fsspec", "mpmath",
             "markupsafe", "regex", "requests", "urllib3", "idna", "certifi", "safetensors", "huggingface_hub")
# Submodules never imported for prompts: test suites, and modules that print or open something when imported
# (`sympy.this` prints its Zen, as the standard library's `this` does).
_SKIPPED_SUBMODULES = {"tests", "testing", "conftest", "benchmarks", "this", "antigravity"}
# A prompt sharing this many consecutive words with an evaluation prompt counts as overlapping it.
OVERLAP_WORDS = 8

# Importing these has side effects (a browser, a printed poem, a GUI) or pulls test suites.
_UNSAFE_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "__phello__"}


TASK_TEMPLATES = (
    "Explain {topic} to a beginner in a few sentences.",
    "What are three common misconceptions about {topic}?",
    "Write a short poem about {topic}.",
    "Write the opening paragraph of a story that involves {topic}.",
    "Give me five tips for getting started with {topic}.",
    "Summarize the history of {topic} in one paragraph.",
    "What are the pros and cons of spending a weekend on {topic}?",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "List the steps someone should follow to learn about {topic}.",
    "Compare {topic} with {other} in a short table.",
    "Write a dialogue between two friends discussing {topic}.",
    "Describe {topic} using a simple analogy.",
    "What questions would a curious child ask about {topic}, and how would you answer them?",
    "Write a haiku about {topic}.",
    "Give a one-sentence definition of {topic}, then an example.",
    "Argue for and against the claim that {topic} is overrated.",
    "Write a product description for a book about {topic}.",
    "Plan a one-week study schedule for {topic}.",
    "Write a tweet announcing a new podcast episode about {topic}.",
    "Explain how {topic} and {other} are connected.",
)
PROSE_OPENINGS = (
    "{Topic} is one of those subjects that everyone has an opinion about, but",
    "When I first became interested in {topic}, I had no idea that",
    "The history of {topic} is longer and stranger than most people realise.",
    "In {year}, a young teacher decided to spend a whole year studying {topic}.",
    "Dear Sam,\n\nThank you for your letter about {topic}. I have been thinking about it ever since, and",
    "Chapter 1\n\nNobody in the village talked about {topic} any more, not since",
    "There are three things every beginner should know about {topic}. The first is",
    "Most guides to {topic} start with the basics. This one starts with a mistake:",
    "It was late in the evening when Maria finally understood what {topic} had to do with {other}.",
    "The committee met on Tuesday to discuss {topic}. After a long debate,",
    "Why do so many people find {topic} difficult? Part of the answer lies in",
    "{Topic} and {other} have more in common than it first appears. Both",
    "A short introduction to {topic}\n\n{Topic} can be described as",
    "My grandmother never read a book about {topic}, yet she knew more about it than",
    "The following notes were written for an evening class on {topic}.",
    "Imagine you have one afternoon to learn the essentials of {topic}. Where would you begin?",
    "By the end of {year}, the debate about {topic} had moved from the newspapers to",
    "Step 1: Before you begin with {topic}, make sure that",
    "The old lighthouse keeper had two passions: {topic} and {other}.",
    "Review: a new book on {topic}\n\nThis is not the first book to take on {topic}, but",
    "Frequently asked questions about {topic}\n\nQ: Where should I start?\nA:",
    "Every culture has its own way of thinking about {topic}. In some places,",
    "The first thing you notice when you walk into a room full of people who love {topic} is",
    "Local news: residents gathered on Saturday for a festival celebrating {topic}, where",
    "There is a common belief that {topic} is only for experts. In reality,",
)
# Openings in other languages, over subjects of their own (a topic name in English would read oddly inside them).
FOREIGN_OPENINGS = {
    "French": (("Il était une fois un enfant qui rêvait de voir {subject}.",
                "Depuis toujours, {subject} fascine les voyageurs, car",
                "Chère Claire,\n\nJe t'écris depuis {subject}, où"),
               ("la mer", "la montagne", "Paris", "la forêt", "la rivière", "la vieille gare", "le marché",
                "l'école du village", "la bibliothèque", "le port")),
    "Spanish": (("Había una vez, en {subject}, una familia que",
                 "Desde hace siglos, {subject} atrae a visitantes de todo el mundo porque",
                 "Querido Pablo:\n\nTe escribo desde {subject}, donde"),
                ("el mar", "la sierra", "Madrid", "el bosque", "el río", "la plaza mayor", "el mercado",
                 "la escuela", "la biblioteca", "el puerto")),
    "German": (("Es war einmal ein Kind, das jeden Tag an {subject} dachte, bis",
                "Seit vielen Jahren besuchen Menschen aus aller Welt {subject}, denn",
                "Liebe Anna,\n\nheute habe ich endlich {subject} gesehen, und"),
               ("das Meer", "die Berge", "Berlin", "den Wald", "den Fluss", "den Marktplatz", "den Bahnhof",
                "die Schule", "die Bibliothek", "den Hafen")),
    "Italian": (("Dopo tanti anni lontano, tornai a vedere {subject}, e",
                 "Da secoli {subject} attira visitatori da tutto il mondo perché",
                 "Cara Giulia,\n\nogni mattina guardo {subject} dalla finestra e"),
                ("il mare", "le montagne", "Roma", "il bosco", "il fiume", "la piazza", "il mercato",
                 "la scuola", "la biblioteca", "il porto")),
    "Portuguese": (("Era uma vez um menino que adorava {subject}, e",
                    "Há séculos {subject} atrai visitantes de todo o mundo porque",
                    "Querida Ana,\n\nhoje visitei {subject} e"),
                   ("o mar", "a serra", "Lisboa", "a floresta", "o rio", "a praça", "o mercado", "a escola",
                    "a biblioteca", "o porto")),
}
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian", "Hindi",
             "Arabic")
_WORD_PROBLEMS = (
    "A shop sells {a} apples for ${b} each and {c} pears for ${d} each. How much do {a} apples and {c} pears cost in "
    "total? Explain your steps.",
    "A train travels {a} km in {b} hours, then {c} km in {d} hours. What is its average speed over the whole trip? "
    "Show your reasoning.",
    "A class has {a} students. {b} of them walk to school and {c} take the bus; the rest cycle. How many cycle? "
    "Explain.",
    "Tom saves ${a} a week for {b} weeks and then spends ${c}. How much money does he have left? Reason step by step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter? Show the formulas you use.",
    "If {a} workers build a wall in {b} days, how many days would {c} workers need at the same pace? Explain.",
)


def library_code_prompts(libraries: tuple[str, ...] = LIBRARIES) -> list[str]:
    """"Complete the following Python function" prompts for every documented function and public method of the
    whole standard library and of `libraries` (those installed; submodules that fail to import are skipped), in a
    fixed order: what an instruct target answers."""
    return [HUMANEVAL_TEMPLATE.format(prompt=body) for body in library_functions(libraries)]


def library_code_openings(libraries: tuple[str, ...] = LIBRARIES) -> list[str]:
    """The same functions as code openings (signature and docstring, as HumanEval's own prompts): what a base model
    continues with the function's body."""
    return list(library_functions(libraries))


@functools.cache
def library_functions(libraries: tuple[str, ...] = LIBRARIES) -> tuple[str, ...]:
    """Signature + docstring summary of every documented function and public method of the whole standard library
    and of `libraries`, deduplicated, in a fixed order. Importing every submodule takes ~20 s, once per process."""
    with warnings.catch_warnings():  # deprecated submodules announce themselves on import
        warnings.simplefilter("ignore")
        bodies = [body for body, _ in _documented_functions(library_modules(libraries), methods=True)]
    # A default printed with its memory address (`<function f at 0x7f...>`) differs in every process.
    return tuple(b for b in dict.fromkeys(bodies) if " at 0x" not in b)


@functools.cache
def library_modules(libraries: tuple[str, ...] = LIBRARIES) -> tuple[str, ...]:
    """The whole standard library and the public submodules of the installed `libraries`."""
    modules = list(_whole_stdlib())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for library in libraries:
            modules += _submodules(library)
    return tuple(modules)


def _documented_functions(modules: Iterable[str], methods: bool = False) -> Iterator[tuple[str, object]]:
    """(prompt body, function) for each documented public function of `modules` (and of their public classes when
    `methods`): signature + docstring summary, as in a HumanEval prompt."""
    seen = set()
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # platform-specific modules
            continue
        owners = [module]
        if methods:
            owners += [c for n, c in inspect.getmembers(module, inspect.isclass)
                       if not n.startswith("_") and c.__module__ == module.__name__]
        for owner in owners:
            for name, func in inspect.getmembers(owner, inspect.isfunction):
                doc = inspect.getdoc(func)
                key = (getattr(func, "__qualname__", name), func.__module__)
                if name.startswith("_") or not doc or func.__module__ != module.__name__ or key in seen:
                    continue
                try:
                    signature = str(inspect.signature(func))
                except (TypeError, ValueError):
                    continue
                summary = doc.split("\n\n")[0].strip().replace('"""', "'''")
                seen.add(key)
                yield f'def {name}{signature}:\n    """{summary}\n    """\n', func


def _whole_stdlib() -> tuple[str, ...]:
    return tuple(sorted(m for m in sys.stdlib_module_names if m not in _UNSAFE_MODULES))


def documentation_openings(libraries: tuple[str, ...] = LIBRARIES, sentences: int = 2) -> list[str]:
    """Prose openings from documentation: the first `sentences` sentences of the first paragraph of every module and
    public class docstring of the standard library and of `libraries`, where that paragraph is prose (a full
    sentence of at least 8 words, no code or markup), in a fixed order."""
    openings = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in library_modules(libraries):
            try:  # imported already by `library_modules`' walk or `library_functions`: a dictionary lookup then
                module = importlib.import_module(name)
            except ImportError:
                continue
            classes = [c for n, c in inspect.getmembers(module, inspect.isclass)
                       if not n.startswith("_") and c.__module__ == name]
            for owner in (module, *classes):
                doc = inspect.getdoc(owner)
                paragraph = " ".join(doc.split("\n\n")[0].split()) if doc else ""
                opening = " ".join(re.split(r"(?<=[.!?])\s+", paragraph)[:sentences])
                if len(opening.split()) >= 8 and opening[-1] in ".!?" and not re.search(r"[{}<>|=`]|::|\w\(", opening):
                    openings.append(opening)
    return list(dict.fromkeys(openings))


def prose_openings(count: int, seed: int = 0) -> list[str]:
    """`count` distinct openings of prose for a base model to continue (fewer when the templates run out): essay,
    story, letter, news and how-to openings over `data.CHAT_TOPICS`, and openings in other languages over their own
    subjects."""
    rng = random.Random(seed)
    openings: dict[str, None] = {}
    for _ in range(20 * count):
        if len(openings) >= count:
            break
        if rng.random() < 0.2:
            language = rng.choice(list(FOREIGN_OPENINGS))
            templates, subjects = FOREIGN_OPENINGS[language]
            openings.setdefault(rng.choice(templates).format(subject=rng.choice(subjects)))
        else:
            topic, other = rng.sample(CHAT_TOPICS, 2)
            opening = rng.choice(PROSE_OPENINGS).format(topic=topic, other=other, year=rng.randint(1850, 2024),
                                                       Topic=topic[0].upper() + topic[1:])
            openings.setdefault(opening)
    return list(openings)


def _submodules(library: str) -> list[str]:
    """`library` and its public submodules (no tests, no private ones), or nothing when it is not installed."""
    try:
        package = importlib.import_module(library)
    except ImportError:
        return []
    names = [library]
    for info in pkgutil.walk_packages(getattr(package, "__path__", []), prefix=f"{library}.", onerror=lambda _: None):
        parts = info.name.split(".")
        if not any(part.startswith("_") or part in _SKIPPED_SUBMODULES for part in parts):
            names.append(info.name)
    return names


def task_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct chat, writing, reasoning and other-language requests (fewer when the templates run out):
    task templates over `data.CHAT_TOPICS`, some asked in another language, and arithmetic word problems."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}
    templated = len(TASK_TEMPLATES) * len(CHAT_TOPICS) * (len(LANGUAGES) + 1)
    for _ in range(20 * count):
        if len(prompts) >= count:
            break
        if rng.random() < 0.25:
            values = {k: rng.randint(2, 99) for k in "abcd"}
            prompts.setdefault(rng.choice(_WORD_PROBLEMS).format(**values))
        elif len(prompts) < templated:
            topic, other = rng.sample(CHAT_TOPICS, 2)
            prompt = rng.choice(TASK_TEMPLATES).format(topic=topic, other=other)
            if rng.random() < 0.3:
                prompt += f" Answer in {rng.choice(LANGUAGES)}."
            prompts.setdefault(prompt)
    return list(prompts)


def normalized(text: str) -> str:
    """Case- and whitespace-blind form of a prompt, for deduplication."""
    return " ".join(text.casefold().split())


def _shingles(text: str, words: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    tokens = re.findall(r"\w+", text.casefold())
    return {tuple(tokens[i : i + words]) for i in range(max(len(tokens) - words + 1, 0))}


@dataclass
class PromptReport:
    """What `prepare_prompts` kept and dropped, per source (the dataset card's numbers)."""

    sources: dict[str, int] = field(default_factory=dict)  # source -> prompts it gave
    duplicates: int = 0
    overlapping: int = 0  # shared a run of OVERLAP_WORDS words with an evaluation prompt
    named_like_evaluation: int = 0  # defined a function an evaluation prompt defines
    evaluation_prompts: int = 0
    kept: int = 0


def prepare_prompts(
    sources: dict[str, Iterable[str]], evaluation: Iterable[str]
) -> tuple[list[str], PromptReport]:
    """The prompts of every source, in order, deduplicated and held apart from `evaluation` (the prompts of every
    suite results are reported on), with the report of what was dropped."""
    evaluation = list(evaluation)
    banned = set().union(*(_shingles(p) for p in evaluation)) if evaluation else set()
    names = {name for p in evaluation for name in re.findall(r"def (\w+)\(", p)}
    report, seen, kept = PromptReport(evaluation_prompts=len(evaluation)), set(), []
    for source, prompts in sources.items():
        prompts = list(prompts)
        report.sources[source] = len(prompts)
        for prompt in prompts:
            key = normalized(prompt)
            if key in seen:
                report.duplicates += 1
            elif names & set(re.findall(r"def (\w+)\(", prompt)):
                report.named_like_evaluation += 1
            elif banned & _shingles(prompt):
                report.overlapping += 1
            else:
                seen.add(key)
                kept.append(prompt)
    report.kept = len(kept)
    return kept, report


__all__ = ["LIBRARIES", "OVERLAP_WORDS", "PromptReport", "documentation_openings", "library_code_openings",
           "library_code_prompts", "normalized", "prepare_prompts", "prose_openings", "task_prompts"]
