"""``sftpack verify``: the project's exactness proof, run on the user's own model and data.

For a sample of the user's conversations (text, or with images for a vision-language
family), every packing path builds its rows exactly as ``sftpack train`` feeds them
(:func:`sftpack.loop.make_source`: the trainer's micro-batches, the loader's rows, the
offline path's prepacked rows re-read), in each boundary mode, and each row goes through the
model's own Hugging Face class against each of its samples run alone: the logits of every
real token, the token-mean loss over the row's targets and every parameter gradient
(:func:`sftpack.multimodal._exactness.compare_packed_alone`). A row whose sequences are not
samples of the input (tokens changed on the way) fails as well.

The tolerance is fixed by the model's shape, never by the run: packed and alone compute the
same function in other summation orders, and an ``n``-term sum is off by at most ``n * u``
of its terms' magnitude sum (Higham, *Accuracy and Stability of Numerical Algorithms*,
section 3.1). :func:`rounding_chain` bounds ``n`` for one forward and backward pass of the
model over a row (:func:`tolerance`; both live in :mod:`sftpack.exactness`, beside the guard
every packed training run passes); in float64 the bound is ``2 * n * u`` (two runs) of
the compared values' magnitude (at least 1), with ``u = 2**-53``; in float32 the
``sqrt(n) * u`` growth of Higham & Mary (2019) with ``lambda = 10`` (exceeded with
probability below 1e-20), ``2 * 10 * sqrt(n) * u`` with ``u = 2**-24``.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import loop
from .._optional import from_pretrained
from ..chat import tokenize_conversations, tokenizer_info
from ..data import default_tokenizer
from ..exactness import (
    UNIT_ROUNDOFF,
    PackingProbe,
    alone_text_logits,
    packed_text_logits,
    probe_packing,
    rounding_chain,
    tolerance,
)
from ..handoff import PackedBatch
from ..handoff.unpack import unpack
from ..hybrid import CoveredLayer, covered_layers, rounding_dtype
from ..loop import TrainConfig, make_source, media_samples
from ..multimodal import compare_packed_alone, family_for  # loaded already: make_source's loader path imports it
from ..sample import Sample

__all__ = ["PATHS", "PathCheck", "VerifyReport", "rounding_chain", "tolerance", "verify"]

#: the packing paths verify checks, in the table's order
PATHS = ("trainer", "loader", "offline")
#: boundary modes (``TrainConfig.boundaries``): real + padded boundaries, or the padded ones for both
MODES = ("real", "padded")


@dataclass(frozen=True)
class PathCheck:
    """One line of the table: one path in one boundary mode, over all its rows."""

    path: str
    boundaries: str
    rows: int  #: micro-batches run (each one or more packed rows)
    sequences: int  #: sequences in them
    covered: int  #: distinct samples of the input among them (a path that lost one fails)
    logits: float  #: the largest |packed - alone| logit of any real token
    loss: float  #: the largest |packed - alone| token-mean loss of a micro-batch
    grads: float  #: the largest |packed - alone| gradient entry
    tolerance: dict[str, float]  #: per quantity (:func:`tolerance`)
    first: str | None = None  #: the first sample that differs, and by how much
    refused: str | None = None  #: why the path does not take this model's data (nothing ran)

    @property
    def ok(self) -> bool:
        return self.first is None


@dataclass
class VerifyReport:
    """What :func:`verify` found."""

    model: str  #: the model folder, or what was built from a config
    kind: str  #: ``"text"`` or the vision-language family's name
    dtype: str
    conversations: int  #: conversations read
    samples: int  #: samples they gave (over-long ones split)
    chain: int  #: the rounding chain the tolerances are derived from (:func:`rounding_chain`)
    checks: list[PathCheck] = field(default_factory=list)
    #: conversations the tokenizer left out (``on_bad_row="skip"``), by reason
    skipped: dict[str, int] = field(default_factory=dict)
    #: the layers that carry state along the sequence, kept apart (:func:`sftpack.hybrid.keep_apart`)
    hybrid: tuple[CoveredLayer, ...] = ()
    #: the precision the tolerances are derived for: ``dtype``, or float32 where the model's own
    #: code rounds to it (:func:`sftpack.hybrid.rounding_dtype`)
    rounds_in: str = ""
    #: in a dtype other than float64: the float64 leak probe of the model
    #: (:func:`sftpack.exactness.probe_packing`), which sees a leak smaller than that dtype's tolerance
    leak: PackingProbe | None = None

    @property
    def checked(self) -> bool:
        """At least one path ran (the others may be refused: not offered for this model's data)."""
        return any(c.refused is None for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.checked and all(c.ok for c in self.checks) and (self.leak is None or self.leak.ok)

    @property
    def first_failure(self) -> PathCheck | None:
        return next((c for c in self.checks if not c.ok), None)


class _Subject:
    """The model under test: how a packed micro-batch and one sample alone run through it."""

    def __init__(self, model: Any, family: Any = None) -> None:
        self.model, self.family = model, family

    def packed(self, batch: PackedBatch, pad_between_seqs: bool) -> torch.Tensor:
        if self.family is not None:
            return self.family.packed_logits(self.model, batch, pad_between_seqs=pad_between_seqs)
        return packed_text_logits(self.model, batch, pad_between_seqs=pad_between_seqs)

    def alone(self, model: Any, sample: Sample) -> torch.Tensor:
        if self.family is not None:
            return self.family.alone_logits(model, sample)
        return alone_text_logits(model, sample)

    def part_of(self, name: str) -> str:
        return "language" if self.family is None else self.family.part_of(name)


def _key(ids: torch.Tensor | Any) -> bytes:
    return torch.as_tensor(ids, dtype=torch.int64).cpu().numpy().tobytes()


def _name(sample: Sample) -> str:
    piece = sample.meta.get("piece", 0) if sample.meta else 0
    return f"conversation {sample.conversation_id!r}" + (f" (piece {piece})" if piece else "")


def _micro_batches(
    path: str,
    mode: str,
    samples: list[Sample],
    prepacked: Any,
    settings: dict[str, Any],
    pad_id: int,
    vocab: Any,
) -> list[Any]:
    """The micro-batches ``sftpack train`` would run for ``samples`` on ``path`` in ``mode``
    (:func:`sftpack.loop.make_source`), covering every sample: the trainer's one step of all
    of them, every row of the prepack, the loader's rows until each sample was seen."""

    per_step = {"trainer": len(samples), "offline": len(prepacked) if prepacked is not None else 1}.get(path, 1)
    config = TrainConfig(packing=path, steps=1, batch_size=per_step, boundaries=mode, **settings)
    if path == "offline":
        return make_source(config, prepacked=prepacked, pad_id=pad_id, vocab=vocab).next_step()
    source = make_source(config, samples=samples, pad_id=pad_id)
    if path == "trainer":
        return source.next_step()
    want, seen, out = {_key(s.input_ids) for s in samples}, set[bytes](), []
    for _ in range(4 * len(samples) + 4):  # the loader repeats its epochs: stop once all were seen
        for mb in source.next_step():
            assert isinstance(mb, PackedBatch)  # a packing path's micro-batch
            keys = {_key(x) for x in unpack(mb.input_ids, mb)}
            if not keys <= seen:
                out.append(mb)
                seen |= keys
        if want <= seen:
            break
    return out


def verify(
    conversations: Iterable[Any],
    *,
    model: str | os.PathLike[str] | None = None,
    family: str | None = None,
    images: bool = False,
    limit: int = 8,
    max_seq_len: int = 256,
    pad_multiple: int = 1,
    dtype: torch.dtype = torch.float64,
    paths: Sequence[str] = PATHS,
    modes: Sequence[str] = MODES,
    seed: int = 0,
    tamper: Callable[[PackedBatch], PackedBatch] | None = None,
    progress: Callable[[str, int], Any] | None = None,
    on_bad_row: str = "error",
) -> VerifyReport:
    """Run the first ``limit`` of ``conversations`` through every path and compare each packed
    micro-batch with its samples alone, through the model (module docstring).

    Args:
        conversations: what :func:`sftpack.chat.read_conversations` gives (or mappings with
            ``messages``); with ``images``, conversations with image parts.
        model: a local model folder (``save_pretrained``: config, weights, tokenizer and, for a
            vision-language model, ``preprocessor_config.json``); its tokenizer, chat template
            and image processor are used. ``None``: a tiny model built from a config (seeded):
            a small Llama over the embedded tokenizer for text, ``family``'s tiny model for images.
        family: with images and no ``model``: the family of the tiny model (default Qwen2-VL);
            with a ``model`` folder the family is its ``config.model_type`` (refused if unknown).
        images: the conversations have images (a vision-language model is needed).
        limit: conversations checked.
        max_seq_len: row width (and the over-long limit: longer conversations are split).
        pad_multiple: each sequence's padding multiple (``2 * CP``).
        dtype: ``torch.float64`` (the default: the tolerances are then tight) or ``torch.float32``:
            the check in float32 (its tolerance is about 1e4 times wider, wide enough to hide a
            small leak: a tiny LFM2's convolution leaks 4.5e-5 against 9.3e-5), and with it the
            float64 leak probe (:func:`sftpack.exactness.probe_packing`, the report's ``leak``),
            which fails such a model whatever the float32 table says.
        paths, modes: which of :data:`PATHS` and :data:`MODES` to check.
        seed: the tiny model's weights and the paths' order.
        tamper: a negative control: edits every micro-batch before it runs (the check must then
            fail).
        progress: how the check reports its progress (nothing is printed here):
            ``progress(label, total)`` is called as each path and boundary mode starts, ``label``
            naming them (``"trainer, real boundaries (1/6)"``), ``total`` its micro-batches; it
            returns an object whose ``update(1)`` is called after each micro-batch and ``close()``
            at the end (``sftpack verify`` passes a :class:`sftpack._progress.Bar`).
        on_bad_row: a conversation the tokenizer cannot take (the template refuses it, no
            trainable token...): ``"error"`` raises naming it; ``"skip"`` leaves it out of every
            path alike and counts it in the report's ``skipped``, as ``sftpack train`` would.

    The model runs with dropout off (``eval()``; gradients still flow): dropout draws other masks
    for other layouts, which is no packing difference.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    for p in paths:
        if p not in PATHS:
            raise ValueError(f"unknown path {p!r}: choose from {', '.join(PATHS)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown boundary mode {m!r}: choose from {', '.join(MODES)}")
    fam = None
    if images or (model is not None and family is None and _is_vlm_folder(model)):
        fam = family_for(model if model is not None else family)
        images = True
    elif family is not None:
        raise ValueError(f"family={family!r} names a vision-language model: pass images=True (data with images)")
    convs = list(itertools.islice(conversations, limit))
    if not convs:
        raise ValueError("no conversations to verify")
    tok, processor = _tokenizer(model, fam)
    samples, skipped = _samples(convs, tok, processor, fam, max_seq_len, on_bad_row)
    if not samples:
        raise ValueError("the conversations gave no sample to verify")
    pad_id, vocab = tokenizer_info(tok)["pad_id"], None  # as sftpack train pads
    if model is not None:
        net = fam.pretrained(model, dtype=dtype) if fam is not None else loop.load_model(os.fspath(model), dtype=dtype)
        what = os.fspath(model)
    else:  # a tiny model over the ids of the data, renumbered (its head is then small: a quick check)
        keep = loop.media_token_ids(fam, tok).values() if fam is not None else ()
        samples, vocab = loop.compact_vocabulary(samples, keep=keep)
        pad_id = 0
        if fam is None:
            net = loop.build_model(len(vocab), seed=seed, dtype=dtype, impl="transformers")
            what = f"a tiny Llama built from a config (seed {seed}), over the {len(vocab):,} ids of the data"
        else:
            net = loop.build_media_model(fam, tok, vocab=vocab, seed=seed, dtype=dtype)
            what = f"a tiny {fam.name} built from a config (seed {seed}), over the {len(vocab):,} ids of the data"
    # dropout off (gradients still flow): its masks are drawn anew for every layout, so with it on
    # packed and alone would differ by chance, not by packing (GPT-2's and OPT's configs default to 0.1)
    net.eval()
    subject = _Subject(net, fam)
    settings = {"max_seq_len": max_seq_len, "pad_multiple": pad_multiple, "seed": seed}
    patches = sum(s.num_patches for s in samples)
    chain = rounding_chain(net, max_seq_len * len(samples), patches)
    report = VerifyReport(
        model=what,
        kind="text" if fam is None else fam.name,
        dtype=str(dtype).removeprefix("torch."),
        conversations=len(convs),
        samples=len(samples),
        chain=chain,
        skipped=skipped,
        hybrid=covered_layers(net),
        rounds_in=str(rounding_dtype(net, dtype)).removeprefix("torch."),
    )
    if dtype != torch.float64:  # a leak can hide below this dtype's tolerance: the float64 probe sees it
        report.leak = probe_packing(net, pad_multiple=pad_multiple, family=fam)
    todo = [(p, m) for p in paths for m in modes]
    with tempfile.TemporaryDirectory(prefix="sftpack-verify-") as tmp:
        prepacked, refused = None, None
        if "offline" in paths:
            try:
                prepacked = _prepack(convs, tmp, tok, processor, fam, max_seq_len, pad_multiple, seed, on_bad_row)
            except ValueError as e:  # a setup the offline path does not take: said, not a difference
                refused = " ".join(str(e).split())
        by_key = {_key(s.input_ids): s for s in samples}
        for i, (path, mode) in enumerate(todo):
            if path == "offline" and refused is not None:
                report.checks.append(_refused(path, mode, refused))
                continue
            mbs = _micro_batches(path, mode, samples, prepacked, settings, pad_id, vocab)
            bar = progress(f"{path}, {mode} boundaries ({i + 1}/{len(todo)})", len(mbs)) if progress else None
            try:
                report.checks.append(_check(subject, path, mode, mbs, by_key, chain, dtype, tamper, bar))
            finally:
                if bar is not None:
                    bar.close()
    return report


def _refused(path: str, mode: str, why: str) -> PathCheck:
    nothing = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    return PathCheck(path, mode, 0, 0, 0, 0.0, 0.0, 0.0, nothing, refused=why)


def _check(
    subject: _Subject,
    path: str,
    mode: str,
    micro_batches: list[Any],
    by_key: dict[bytes, Sample],
    chain: int,
    dtype: torch.dtype,
    tamper: Callable[[PackedBatch], PackedBatch] | None,
    bar: Any = None,
) -> PathCheck:
    worst = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    tol = {"logits": 0.0, "loss": 0.0, "grads": 0.0}
    first: str | None = None
    sequences = 0
    ran: set[bytes] = set()
    pad_between = mode == "real"
    for r, mb in enumerate(micro_batches):
        keys = [_key(x) for x in unpack(mb.input_ids, mb)]
        found = [by_key.get(k) for k in keys]
        sequences += len(found)
        ran.update(k for k in keys if k in by_key)
        lost = next((i for i, s in enumerate(found) if s is None), None)
        if lost is not None:
            first = first or f"micro-batch {r}, sequence {lost}: its tokens are no sample of the input"
            if bar is not None:
                bar.update(1)
            continue
        run: PackedBatch = tamper(mb) if tamper is not None else mb
        chosen = [s for s in found if s is not None]

        def packed(run: PackedBatch = run) -> torch.Tensor:
            return subject.packed(run, pad_between)

        logits, loss, grads, max_logit, max_grad = compare_packed_alone(
            subject.model, chosen, run, alone=subject.alone, packed=packed, part_of=subject.part_of
        )
        here = {"logits": logits, "loss": loss, "grads": max(grads.values(), default=0.0)}
        rounds = rounding_dtype(subject.model, dtype)  # a hybrid layer's own code may round to float32
        limit = {
            "logits": tolerance(chain, rounds, max_logit),
            "loss": tolerance(chain, rounds, max_logit),
            "grads": tolerance(chain, rounds, max_grad),
        }
        for k in worst:
            worst[k] = max(worst[k], here[k])
            tol[k] = max(tol[k], limit[k])
        bad = [k for k in here if not here[k] <= limit[k]]
        if bad and first is None:
            first = _first_differing(subject, run, chosen, pad_between, r, bad, here, limit)
        if bar is not None:
            bar.update(1)
    missing = [s for k, s in by_key.items() if k not in ran]
    if missing and first is None:
        first = f"{_name(missing[0])} was never run: the path lost {len(missing)} of {len(by_key)} samples"
    return PathCheck(
        path=path,
        boundaries=mode,
        rows=len(micro_batches),
        sequences=sequences,
        covered=len(ran),
        logits=worst["logits"],
        loss=worst["loss"],
        grads=worst["grads"],
        tolerance=tol,
        first=first,
    )


def _first_differing(
    subject: _Subject,
    batch: PackedBatch,
    samples: list[Sample],
    pad_between: bool,
    r: int,
    bad: list[str],
    here: dict[str, float],
    limit: dict[str, float],
) -> str:
    """Which sample of a failing micro-batch differs first, by its logits (else the batch)."""
    with torch.no_grad():
        packed = subject.packed(batch, pad_between)
        cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
        for i, s in enumerate(samples):
            n = cu[i + 1] - cu[i]
            d = float((packed[cup[i] : cup[i] + n] - subject.alone(subject.model, s)).abs().max())
            if not d <= limit["logits"]:
                return f"{_name(s)} (micro-batch {r}): logits differ by {d:.3g} (tolerance {limit['logits']:.3g})"
    k = bad[0]
    return f"micro-batch {r} ({_name(samples[0])} first): {k} differ by {here[k]:.3g} (tolerance {limit[k]:.3g})"


def _is_vlm_folder(model: str | os.PathLike[str]) -> bool:
    cfg = Path(model) / "config.json"
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "vision_config" in data


def _tokenizer(model: str | os.PathLike[str] | None, fam: Any) -> tuple[Any, Any]:
    """The tokenizer (and with a family its image processor): the model folder's, else the default."""
    if fam is not None:
        return fam.tokenizer(model), fam.image_processor(model)
    if model is None:
        return default_tokenizer(), None

    return from_pretrained("AutoTokenizer", model, local_files_only=True), None


def _samples(
    convs: list[Any], tok: Any, processor: Any, fam: Any, max_seq_len: int, on_bad_row: str
) -> tuple[list[Sample], dict[str, int]]:
    """The samples ``sftpack train`` tokenizes (over-long conversations split), and the
    conversations the tokenizer left out by reason."""
    if fam is None:
        got = tokenize_conversations(convs, tok, max_seq_len=max_seq_len, overlong="split", on_bad_row=on_bad_row)
        samples = list(got)
        return samples, {k: v for k, v in got.stats.skipped.items() if v}
    samples, media = media_samples(
        convs, max_seq_len=max_seq_len, family=fam, tokenizer=tok, processor=processor, on_bad_row=on_bad_row
    )
    return samples, dict(media.dropped)


def _prepack(
    convs: list[Any],
    tmp: str,
    tok: Any,
    processor: Any,
    fam: Any,
    max_seq_len: int,
    pad_multiple: int,
    seed: int,
    on_bad_row: str,
) -> Any:
    from ..offline import PrepackedDataset, prepack  # start-up: the offline path only for --paths offline

    out = os.path.join(tmp, "prepack")
    extra: dict[str, Any] = {}
    if fam is not None:
        extra = {"images": True, "family": fam, "processor": processor}
    prepack(
        convs,
        out,
        tokenizer=tok,
        max_seq_len=max_seq_len,
        pad_multiple=pad_multiple,
        seed=seed,
        on_bad_row=on_bad_row,
        **extra,
    )
    return PrepackedDataset(out)
