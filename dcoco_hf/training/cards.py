"""The cards a `dcoco-hf train` run writes: the dataset card of its prompts and answers (`<out>/data/README.md`) and
the drafter's model card (`<out>/drafter/README.md`: how to load it, the command that made it, held-out tau, its
architecture, the target's terms, the wall time of each phase and the checkpoints' measurements)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

import torch

from ..runtime.drafter import DCOCODrafter
from .data import learned_token_counts
from .prompt_sources import OVERLAP_WORDS, PromptReport
from .run import TrainRun

def dataset_card(report: PromptReport, target: str, command: str, license: str = "other", provenance: str = "") -> str:
    """A dataset card (README.md, with the Hub's metadata) for a folder of the target's answers to these prompts:
    where the prompts come from and what was dropped. `records_section` adds the answers once they are written."""
    rows = "\n".join(f"| {source} | {count} |" for source, count in report.sources.items())
    sizes = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"))
    size = next((name for bound, name in sizes if report.kept < bound), "n>1M")
    origin = f"\n{provenance}\n" if provenance else ""
    terms = "" if license != "other" else (
        f"\nThe answers are {target}'s output: its licence and terms apply to them.\n")
    return f"""---
pretty_name: Training prompts and answers for a drafter of {target}
license: {license}
language:
- en
task_categories:
- text-generation
size_categories:
- {size}
tags:
- dcoco-hf
- speculative-decoding
- drafter-training
- synthetic
---

# Training prompts and answers for a drafter of {target}

Made by `{command}`. Each record is a prompt and the target's own greedy answer or continuation (token ids and a
mask over what the target wrote), what a DFlash/DCOCO drafter learns to predict. Prompts are mostly English; some
ask for an answer in another language, and a base model's prose openings are partly French, Spanish, German, Italian
or Portuguese.
{terms}{origin}
## Sources

| source | prompts |
| --- | --- |
{rows}

Code prompts and code openings are the signatures and docstrings of documented functions of the Python standard
library and of installed open-source libraries (each under its own licence); documentation openings are the first
sentences of their module and class docstrings; task prompts and prose openings are built from templates over topics
and languages, word problems from random numbers; questions and exercises, where present, were written by the
target itself.

## Deduplication and held-out evaluation

- {report.duplicates} duplicates dropped (case- and whitespace-blind).
- {report.named_like_evaluation} prompts dropped for defining a function an evaluation prompt defines.
- {report.overlapping} prompts dropped for sharing a run of {OVERLAP_WORDS} words with one of the
  {report.evaluation_prompts} evaluation prompts.
- {report.kept} prompts kept.
"""


RECORDS_HEADING = "\n## Records\n"


def records_section(records: int, tokens: int, answer_tokens: int, max_new_tokens: int, shard_size: int,
                    left_out: int = 0, max_prompt_tokens: int | None = None) -> str:
    """The dataset card's account of the written answers (`dataset_card` describes their prompts)."""
    long = (f"| left out | {left_out:,} prompt(s) of more than {max_prompt_tokens} tokens (`left_out.json`): their "
            "answers would not fit the records training reads |\n") if left_out else ""
    return f"""{RECORDS_HEADING}
| | |
| --- | --- |
| records | {records:,}: one prompt each, answered greedily, up to {max_new_tokens} new tokens |
| tokens | {tokens:,} in all, {answer_tokens:,} of them written by the target (`loss_mask`) |
{long}| files | `shard-*.safetensors`, {shard_size} records each (`input_ids`, `loss_mask`; no code runs on load) |

```python
from dcoco_hf.training.data import load_shards

records = load_shards("path/to/this/folder")  # [{{"input_ids": [T] token ids, "loss_mask": [T] bool}}, ...]
```
"""


LICENCE_FILES = ("LICENSE*", "LICENCE*", "NOTICE*", "*TERMS*", "USE_POLICY*")
NOTICE_FILE = "NOTICE"  # the notice a known target's terms require (`HubTarget.notice`), written beside the weights


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
{recipe_section(run)}
## Held-out tau

Committed tokens per target forward (greedy, whole blocks every cycle) on {held_out} held-out prompt(s) that were not
trained on, {run.tau_tokens} new tokens each, per block size (recorded as `block_tau` in generation_config.json):

| block size | tau |
| --- | --- |
{rows}
"""


def recipe_section(run: TrainRun) -> str:
    """The --recipe file the command read, in full (its flags override it): with it the card alone rebuilds the
    drafter, wherever the file itself is."""
    if run.recipe is None:
        return ""
    return f"""
with the recipe file it names (flags given beside it override the file):

```yaml
{run.recipe.strip()}
```
"""


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


def draft_coverage(drafter: DCOCODrafter, records: list[dict[str, torch.Tensor]]) -> float | None:
    """The share of the target's answer tokens (`loss_mask`) inside the drafter's draft vocabulary (None: it drafts
    from the whole vocabulary)."""
    if drafter.draft_token_ids is None:
        return None
    counts = learned_token_counts(records, drafter.config.vocab_size)
    return float(counts[drafter.draft_token_ids].sum() / counts.sum())


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


__all__ = ["NOTICE_FILE", "RECORDS_HEADING", "architecture_section", "dataset_card", "draft_coverage", "model_card",
           "recipe_section", "records_section", "training_section", "write_licences"]
