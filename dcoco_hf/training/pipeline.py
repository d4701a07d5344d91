"""`dcoco-hf train` end to end: prompts, the target's answers, their target features, stage 1, stage 2, a Hub-ready
drafter folder (the run's files: `run.py`).

Every phase leaves its result on disk and is recorded in `<out>/train_state.json` when it finishes, so the same
command run again skips finished phases and resumes the unfinished one (answers and features shard by shard, stages
from their last Trainer checkpoint). The stages are `stages.train_stage`, the function `scripts/train_drafter.py`
runs; the cards are `cards.py`'s.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, TrainerCallback
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ..runtime.block_choice import block_size_for_call
from ..runtime.drafter import DCOCODrafter, spread_layer_ids
from ..runtime.logs import log
from ..runtime.prompts import padding_id, prompt_input_ids
from .data import (
    RECORDS_PER_SHARD,
    cache_target_features,
    load_shards,
    regenerate,
    self_instruct_exercises,
    self_instruct_prompts,
)
from .phases import PHASES
from .cards import (
    RECORDS_HEADING,
    architecture_section,
    dataset_card,
    draft_coverage,
    model_card,
    records_section,
    training_section,
    write_licences,
)
from .prompt_sources import (
    documentation_openings,
    library_code_openings,
    library_code_prompts,
    prepare_prompts,
    prose_openings,
    task_prompts,
)
from .retarget import held_out_stats, measure_tau
from .run import PROGRESS_FILE, STATE_FILE, RunState, TrainRun, read_progress
from .stages import StageOptions, train_stage

# Phases one process runs while the others wait (the rest run in every process, each on its part).
MAIN_PROCESS_PHASES = ("prompts", "final")
# Above LARGE_VOCAB tokens (Gemma's 262,144, Qwen's 151,936) the drafter's LM head costs most of a draft: by default it
# proposes from the DRAFT_VOCAB tokens the target writes most, the size drafters of such targets use.
LARGE_VOCAB, DRAFT_VOCAB = 65536, 32768
# The drafter folder's weights: half of fp32's size (a Hub folder, a repository under a size limit), and a drafter
# only proposes, so rounding its weights can cost tau but never exactness.
SAVE_DTYPE = torch.bfloat16


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


__all__ = ["auto_draft_vocab", "held_out_block_tau", "train"]
