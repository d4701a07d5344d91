"""The Hub cards (model_cards/*/README.md, custom_generate/README.md) as the Hub shows them: complete metadata, no link
that only resolves inside this repository, and Python snippets that run as printed, with every name defined.

The snippets name a drafter or data folder the way a local clone of its Hub repository is named, so they run here
from model_cards/; the target's Hub id is swapped for the same model built locally (no network) and generation is
cut to a few tokens."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from dcoco_hf.assets import default_target_path

ROOT = Path(__file__).resolve().parents[1]
CARDS = ROOT / "model_cards"
MODEL_CARDS = sorted(p.parent for p in CARDS.glob("*/config.json"))
# A dataset card: a folder with a README and no drafter. The records themselves (tens of MB of shards) are rebuilt by
# the command in its card.
DATASET_CARDS = sorted(p.parent for p in CARDS.glob("*/README.md") if not (p.parent / "config.json").exists())
HUB_READMES = [*(p / "README.md" for p in MODEL_CARDS + DATASET_CARDS), ROOT / "custom_generate" / "README.md"]
TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROVENANCE = "Q4_1"  # the GGUF the target was rebuilt from

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_MARKDOWN_LINK = re.compile(r"\]\(([^)]+)\)")


def front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n"), f"{readme}: no YAML front matter"
    return yaml.safe_load(text.split("---\n", 2)[1])


def python_snippets(readme: Path) -> list[str]:
    return _PYTHON_BLOCK.findall(readme.read_text())


def run_snippet(code: str, folder: Path, monkeypatch) -> dict:
    """Run `code` as a reader would, from `folder`, on the local target and with few new tokens."""
    code = code.replace(f'"{TARGET_ID}"', repr(str(default_target_path())))
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=8", code)
    monkeypatch.chdir(folder)
    namespace: dict = {"__name__": "__card__"}
    exec(compile(code, str(folder / "README.md"), "exec"), namespace)  # noqa: S102 (our own cards)
    return namespace


def test_every_card_is_found():
    assert {p.name for p in MODEL_CARDS} == {"dcoco-smollm2-135m", "lilicorr-smollm2-135m",
                                             "dflash2-selector-smollm2-135m"}
    assert {p.name for p in DATASET_CARDS} == {"smollm2-135m-answers"}


@pytest.mark.parametrize("card", MODEL_CARDS, ids=lambda p: p.name)
def test_model_card_metadata(card):
    meta = front_matter(card / "README.md")
    assert {"license", "library_name", "pipeline_tag", "language", "base_model", "tags"} <= set(meta)
    assert meta["license"] == "apache-2.0" and meta["base_model"] == TARGET_ID
    assert set(meta.get("datasets", [])) <= {p.name for p in DATASET_CARDS}  # each one a dataset card here
    assert PROVENANCE in (card / "README.md").read_text()


@pytest.mark.parametrize("card", DATASET_CARDS, ids=lambda p: p.name)
def test_dataset_card_metadata(card):
    meta = front_matter(card / "README.md")
    assert {"license", "pretty_name", "task_categories", "language", "size_categories", "tags"} <= set(meta)
    assert PROVENANCE in (card / "README.md").read_text()


@pytest.mark.parametrize("readme", HUB_READMES, ids=lambda p: p.parent.name)
def test_links_resolve_on_the_hub(readme):
    relative = [link for link in _MARKDOWN_LINK.findall(readme.read_text()) if not link.startswith(("https://", "#"))]
    assert not relative, f"{readme}: {relative} resolve only inside the repository"


def test_the_declared_range_is_the_tested_range():
    """pyproject allows no torch or transformers that CI does not run: the oldest CI pins are its lower bounds, the
    newest torch CI installs is the last minor release it allows, and transformers is capped (CI's newest end
    installs the newest release the cap allows)."""
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    declared = {Requirement(spec).name: Requirement(spec).specifier
                for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    ci = (ROOT / ".ci" / "run").read_text()
    torches = sorted(Version(v) for v in re.findall(r"torch==([0-9.]+)", ci))
    oldest_transformers = Version(re.search(r'"transformers==([0-9.]+)\.\*"', ci).group(1))
    assert all(version in declared["torch"] for version in torches)
    assert Version(f"{torches[0].major}.{torches[0].minor - 1}") not in declared["torch"]
    assert Version(f"{torches[-1].major}.{torches[-1].minor + 1}.0") not in declared["torch"]  # untested minor
    assert oldest_transformers in declared["transformers"]
    assert Version(f"{oldest_transformers.major}.{oldest_transformers.minor - 1}") not in declared["transformers"]
    assert any(spec.operator in ("<", "<=") for spec in declared["transformers"])  # a cap: no untested release


def test_custom_generate_asks_for_this_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    requirements = (ROOT / "custom_generate" / "custom_generate" / "requirements.txt").read_text().split()
    assert f"dcoco-hf>={version}" in requirements


@pytest.mark.slow
@pytest.mark.parametrize("card", MODEL_CARDS, ids=lambda p: p.name)
def test_model_card_snippets_run(card, monkeypatch):
    snippets = python_snippets(card / "README.md")
    assert snippets
    for snippet in snippets:
        namespace = run_snippet(snippet, CARDS, monkeypatch)
        assert namespace["drafter"].generation_stats(namespace["out"]).committed_tokens == 8


@pytest.mark.slow
def test_custom_generate_snippet_runs(monkeypatch):
    """Run from the repository root, where the folder and the shipped drafter are."""
    (snippet,) = python_snippets(ROOT / "custom_generate" / "README.md")
    namespace = run_snippet(snippet, ROOT, monkeypatch)
    stats = namespace["drafter"].generation_stats(namespace["out"])
    assert [row.committed_tokens for row in stats] == [8, 8]


def test_the_tracked_files_fit_a_64_mib_copy():
    """Every tracked file together stays under 60 MiB, so a checkout travels whole to a machine that takes 64 MiB."""
    root = Path(__file__).resolve().parents[1]
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout ({error})")
    paths = [root / name for name in listed.decode().split("\0") if name]
    total = sum(path.stat().st_size for path in paths if path.is_file())
    assert total <= 60 * 2**20, f"tracked files hold {total:,} bytes, over 60 MiB"
