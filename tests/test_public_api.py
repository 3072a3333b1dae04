"""The public face of the core, the handoff, the tokenizer, the loader and the trainer paths, the
fused head and the multimodal samples, pinned.

Each package's ``__all__`` is listed here exactly: adding or removing a public
name is a change made in the open, in this file. No object is public under two
paths, except the deliberate aliases listed in one place, ``sftpack._ALIASES``
(the top-level conveniences, the old paths of what moved, the contract's names),
and each of those really is the same object as its home.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import sftpack

API = {
    "sftpack": ["IGNORE_INDEX", "PackedBatch", "Sample", "__version__"],
    "sftpack.sample": [
        "DEFAULT_OVERLONG",
        "IGNORE_INDEX",
        "Overlong",
        "OverlongError",
        "Sample",
        "WeightNormalisation",
        "as_sample",
        "check_sft_sample",
        "check_unweighted",
        "overlong_spans",
        "pair_meta",
        "pair_sequence_id",
        "sft_group",
    ],
    "sftpack.handoff": [
        "Alignment",
        "AlignmentError",
        "CPShard",
        "FP8Recipe",
        "PackedBatch",
        "PackedBatchError",
        "build_row",
        "pack_rows",
        "pad_multiple_for",
        "padded_lengths",
        "segment_ids",
        "shard_for_cp",
        "unpack",
        "unpack_padded",
        "unshard_cp",
    ],
    "sftpack.chat": [
        "BadFileError",
        "BadRowError",
        "BadRowReason",
        "CacheWarning",
        "Conversation",
        "ConversationTemplateError",
        "OnBadRow",
        "ReadStats",
        "TemplateError",
        "TokenizeStats",
        "TrainOn",
        "encode_conversation",
        "read_conversations",
        "tokenize_conversation",
        "tokenize_conversations",
        "tokenize_pair",
    ],
    "sftpack.loader": [
        "PAD_BETWEEN_SEQS",
        "DecidedRow",
        "EnergonPackedBatch",
        "LoaderStats",
        "PackingDataset",
        "PackingTaskEncoder",
        "StateError",
        "StatefulLoader",
        "saved_num_workers",
        "worked_example_row",
    ],
    "sftpack.balance": [
        "NAMED_SIZES",
        "BalanceError",
        "CPMicrobatch",
        "CostError",
        "DynamicCPPlan",
        "SequenceCost",
        "StepPlan",
        "assign",
        "cp_groups",
        "cp_pad_multiple",
        "deal",
        "dynamic_cp",
        "lower_bound",
        "max_over_mean",
        "sequence_cost",
    ],
    "sftpack.trainer": [
        "MicrobatchPlan",
        "PlanError",
        "pack_step",
        "padded_batch",
        "plan_microbatches",
    ],
    "sftpack.attention": [
        "UnsupportedAttentionError",
        "varlen_attention",
        "boundaries_of",
        "hf_attention_forward",
        "register_hf_attention",
        "TRAIN_ATTENTION",
        "register_train_attention",
    ],
    "sftpack.loss": [
        "all_reduce_sequence_sums",
        "count_label_tokens",
        "count_sequences",
        "loss_dtype",
        "normalise_weights",
        "sequence_logprob_means",
        "sequence_logprob_sums",
        "sequence_loss_sums",
        "sequence_mean_loss",
        "token_losses",
        "token_mean_loss",
    ],
    "sftpack.objectives": [
        "CHOSEN",
        "REJECTED",
        "Pairs",
        "PreferenceLosses",
        "count_pairs",
        "dpo_loss",
        "pair_mean",
        "pair_sequences",
        "pairs_of",
        "simpo_loss",
    ],
    "sftpack.exactness": [
        "ExactnessReport",
        "InexactPackingError",
        "PackingProbe",
        "TinyCausalLM",
        "check_hf_model",
        "check_plain_model",
        "mark_exact",
        "norms_in_model_dtype",
        "probe_packing",
        "reference_labels",
        "require_exact_packing",
        "rounding_chain",
        "tiny_llama",
        "tolerance",
    ],
    "sftpack.head": ["DEFAULT_CHUNK_BYTES", "fused_linear_cross_entropy", "head_impl"],
    "sftpack.multimodal": [
        "BadImageError",
        "BadImageReason",
        "EncodedVideos",
        "Family",
        "MediaTokenizeStats",
        "PackedCheck",
        "PatchBudgetError",
        "UnsupportedModelError",
        "VideoSampling",
        "check_packed",
        "cp_hidden",
        "cp_vision_outputs",
        "family_for",
        "load_image",
        "plan_rows",
        "tokenize_media_conversation",
        "tokenize_media_conversations",
        "vqa_corpus",
    ],
    "sftpack.handoff.payload": ["ImageMedia", "Media", "PatchMedia", "check_pixel_values"],
    "sftpack.data": ["CHATML_TEMPLATE", "cache_dir", "chatml_template", "default_corpus", "default_tokenizer"],
    "sftpack.testing": [
        "CHAT_STYLES",
        "HYBRID_FAMILIES",
        "CharTokenizer",
        "hybrid_config",
        "samples_from_lengths",
        "save_hybrid_folder",
        "tiny_chat_tokenizer",
    ],
    "sftpack.hybrid": [
        "LAYER_KINDS",
        "MODEL_TYPES",
        "PADDING_BUDGET",
        "ROUTES",
        "CoveredLayer",
        "LayerKind",
        "covered_layers",
        "keep_apart",
        "kernel_route_available",
        "layer_kind",
        "leaking",
        "length_groups",
        "refuse_context_parallel",
        "rounding_dtype",
        "segment_offsets",
        "state_layers_of_config",
    ],
}


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module", sorted(API))
def test_all_is_pinned_and_every_name_resolves(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(API[module])
    assert len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, f"{module}.{name}"


def test_every_alias_is_its_home():
    for alias, home in sftpack._ALIASES.items():
        assert _resolve(alias) is _resolve(home), f"{alias} is not {home}"
        home_module, _, home_name = home.rpartition(".")
        assert home_name in API[home_module], f"the home of {alias}, {home}, is not public"


def test_no_object_is_public_under_two_paths_but_the_listed_aliases():
    """Across the pinned modules, a class or function in one ``__all__`` appears under no other
    public name (in another ``__all__``, or as a public attribute of another package's
    ``__init__``, whose imports are its face), unless the second path is listed in
    ``sftpack._ALIASES``. A plain module's own imports (``loss`` using ``PackedBatch``) are not
    a face and are not counted."""
    home: dict[int, str] = {}
    for module, names in API.items():
        for name in names:
            obj = _resolve(f"{module}.{name}")
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            path = f"{module}.{name}"
            if path in sftpack._ALIASES:
                continue
            assert id(obj) not in home, f"{path} and {home[id(obj)]} are the same object"
            home[id(obj)] = path
    twice = []
    for module in API:
        mod = importlib.import_module(module)
        if not hasattr(mod, "__path__"):  # a plain module, not a package
            continue
        for name in dir(mod):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name)
            path = f"{module}.{name}"
            if id(obj) in home and home[id(obj)] != path and path not in sftpack._ALIASES:
                twice.append(f"{path} (home {home[id(obj)]})")
    assert twice == []


def test_the_contracts_trainer_names_still_work():
    """docs/contract.md section 3 names sftpack.trainer.shard_for_cp and sftpack.trainer.unpack."""
    import sftpack.handoff
    import sftpack.trainer

    assert sftpack.trainer.shard_for_cp is sftpack.handoff.shard_for_cp
    assert sftpack.trainer.unpack is sftpack.handoff.unpack
