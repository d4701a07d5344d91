"""The adapter to transformers (dcoco_hf/runtime/hf_compat.py) against the installed release: each reader of the
assisted loop's internals finds what it reads inside a real `generate(assistant_model=drafter)` call, and nothing
outside one. CI runs this file on the oldest and the newest supported transformers, so a release that moves these
internals fails here, by name, before any output could change."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT_LEN, VOCAB
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

import dcoco_hf.runtime.candidate_generator as runtime
from dcoco_hf.runtime import hf_compat
class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _spy(monkeypatch, name: str) -> list:
    """Record what the drafter's call of `hf_compat.<name>` returned."""
    seen, read = [], getattr(hf_compat, name)

    def recording(*args, **kwargs):
        seen.append(read(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(runtime, name, recording)
    return seen


def _generate(target, drafter, **kwargs):
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               assistant_model=drafter, **kwargs)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_loops_stopping_criteria_are_found(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_stopping_criteria")
    _generate(target, drafter, stopping_criteria=StoppingCriteriaList([_Never()]))
    assert len(seen) == 1 and isinstance(seen[0], StoppingCriteriaList)  # read once per call, at its first cycle
    kinds = {type(criterion) for criterion in seen[0]}
    assert _Never in kinds and MaxLengthCriteria in kinds  # the caller's criteria and generate()'s own


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_loops_scores_are_found_when_asked_for(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_loop_scores")
    _generate(target, drafter)
    assert seen and all(scores is None for scores in seen)  # not asked for: the loop keeps none
    seen.clear()
    _generate(target, drafter, output_scores=True, return_dict_in_generate=True)
    assert seen and all(isinstance(scores, tuple) for scores in seen)
    assert all(score.shape[-1] == VOCAB for scores in seen for score in scores)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_driving_assisted_candidate_generator_is_found(fitted, monkeypatch):
    target, drafter = fitted
    seen = _spy(monkeypatch, "assisted_driver")
    _generate(target, drafter)
    assert len(seen) == 1 and isinstance(seen[0], AssistedCandidateGenerator)


@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_every_verification_reaches_the_engine_with_transformers_matches(fitted, monkeypatch):
    """The engine's acceptance is transformers' own count (`update_candidate_strategy`'s num_matches), cycle by
    cycle, and the committed tokens it books are the sequence transformers returns."""
    target, drafter = fitted  # the constant schedule: a draft every cycle but where none fits before max_length
    reported, update = [], AssistedCandidateGenerator.update_candidate_strategy

    def recording(self, input_ids, scores, num_matches):
        reported.append(int(num_matches))
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", recording)
    accepted = []
    for seed in range(4):
        reported.clear()
        ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter)
        stats = drafter.generation_stats(out)
        assert len(reported) - 1 <= len(stats.accepted) <= len(reported)
        assert stats.accepted == reported[: len(stats.accepted)]
        assert stats.committed_tokens == out.shape[1] - PROMPT_LEN
        accepted += stats.accepted
    assert any(accepted)


def test_nothing_is_found_outside_a_generate_call():
    assert hf_compat.assisted_stopping_criteria() is None
    assert hf_compat.assisted_loop_scores() is None
    assert hf_compat.assisted_driver() is None


# ------------------------------------------------------------------------------------------------ one adapter

# The network a Hub folder carries reads the attention implementation as every transformers modeling file does: it
# cannot import the runtime's adapter (tests/test_import_graph.py keeps the network free of runtime modules).
_NETWORK_IDIOM = {("network/modeling_dcoco.py", "_attn_implementation")}


def _transformers_private_names() -> set[str]:
    """Private names of the transformers objects the package handles: configs, models, generation configs, the
    assisted loop's generators, caches, and the special-token tensors generate() sets on a generation config."""
    from transformers import GenerationConfig, GenerationMixin, PreTrainedConfig, PreTrainedModel
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
    from transformers.generation.candidate_generator import CandidateGenerator

    classes = (PreTrainedModel, PreTrainedConfig, GenerationConfig, GenerationMixin, AssistedCandidateGenerator,
               CandidateGenerator, Cache, DynamicCache, DynamicLayer, CacheLayerMixin, StoppingCriteriaList)
    names = ({name for cls in classes for name in dir(cls)} | set(vars(GenerationConfig()))
             | set(vars(PreTrainedConfig())))
    names |= {"_eos_token_tensor", "_pad_token_tensor", "_bos_token_tensor", "_decoder_start_token_tensor"}
    names -= set(dir(torch.Tensor)) | set(dir(torch.nn.Module))  # torch's (a tensor's `_version`), not transformers'
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _reads_of_transformers_internals() -> list[tuple[str, int, str]]:
    """(file, line, what) of every place in the package that touches transformers' internals: a private attribute
    of another object (not `self`/`super()`, which are our own subclasses' conventions), the assisted generator's
    proposal length written, a frame's locals, or transformers' log text."""
    import ast
    from pathlib import Path

    package = Path(hf_compat.__file__).resolve().parents[1]
    private = _transformers_private_names()
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                owner = ast.unparse(node.value)
                if node.attr in private and owner != "self" and not owner.startswith("super("):
                    found.append((where, node.lineno, node.attr))
                elif node.attr == "f_locals" or (node.attr == "num_assistant_tokens" and owner == "driver"):
                    found.append((where, node.lineno, node.attr))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "LOAD REPORT" in node.value:
                found.append((where, node.lineno, "LOAD REPORT"))
    return found


def test_transformers_internals_are_read_in_the_adapter_only():
    """Every read or write of a private name (or log text) of transformers goes through runtime/hf_compat.py, which
    says why and on which releases it was checked; the one exception is the network's modeling idiom."""
    found = _reads_of_transformers_internals()
    outside = [(where, line, name) for where, line, name in found
               if where != "runtime/hf_compat.py" and (where, name) not in _NETWORK_IDIOM]
    assert not outside, f"transformers internals read outside runtime/hf_compat.py: {outside}"
    names = {name for where, _, name in found if where == "runtime/hf_compat.py"}
    # What the adapter reads, as its docstring lists it: a new name there must be documented there too.
    assert names == {"_attn_implementation", "_eos_token_tensor", "_pad_token_tensor", "_from_model_config",
                     "_sample", "f_locals", "num_assistant_tokens"}, names
