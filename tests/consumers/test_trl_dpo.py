"""Cross-check with TRL (issue 42, item 6): sftpack's packed DPO loss equals TRL's own DPO loss.

Three preference pairs in TRL's string format (``prompt`` / ``chosen`` / ``rejected``). TRL's
side is TRL's own code, end to end: a real ``trl.DPOTrainer`` (``loss_type="sigmoid"``,
``beta=0.1``) around a tiny float64 Hugging Face Llama policy and a reference of another seed,
built with sftpack's offline tokenizer; TRL tokenizes the strings (adding EOS), its collator
pads chosen and rejected into one ``[2B, S]`` batch, and ``DPOTrainer.compute_loss`` runs both
models over it and returns the mean sigmoid DPO loss over the pairs. sftpack's side: the same
strings through :func:`sftpack.chat.tokenize_pair`, the six sequences packed into one row with
padding between them and partners apart, one packed forward of each model (Hugging Face kwargs),
:func:`sftpack.loss.sequence_logprob_sums`, :func:`sftpack.objectives.pairs_of`,
:func:`sftpack.objectives.dpo_loss` and :func:`sftpack.objectives.pair_mean`.

Checked: the token ids agree (sftpack's string rule is TRL's), each sequence's summed
log-probability agrees with TRL's fused LM head (``model(..., fused_lm_head=True).log_probs``,
the forward ``compute_loss`` runs), and the loss agrees. Gradients are not compared (TRL's
backward runs through the same float32 kernel; the packed gradients are checked exactly against
each sequence alone in ``test_dpo.py``).

Tolerance, fixed and derived. The models and sftpack's side are float64 (within ~1e-10 of
exact, ``test_dpo.py``), but TRL 1.16's fused LM head (``trl.kernels.chunked_logprob``) rounds
the float64 logits to float32 and runs its log-sum-exp in float32 (u = 2**-24 = 6.0e-8) whatever
the model's dtype, and sums the per-token values in float32. Per token, with |logit| <= Z = 4
(asserted) over V = 284 ids: the target logit's rounding Z*u, the maximum's Z*u, the sum of V
exponentials (each within 2u, V roundings) (V + 2)*u, the log's rounding (Z + ln V)*u: at most
(3Z + V + 3 + Z + ln V)*u = 309u = 1.9e-5. A sequence sums <= 16 such values (asserted), each
of magnitude <= 2Z + ln V < 14: 16 * 1.9e-5 = 3.0e-4 for the values, plus 16 float32 additions of
partial sums below 16 * 14 = 224, 16 * 224u = 2.2e-4: TOL_SUM = 6e-4 >= 5.2e-4 (sftpack's float64
side adds ~1e-10). The pair loss is 1-Lipschitz in its argument beta * (four sums), beta = 0.1:
<= 0.4 * 5.2e-4 = 2.1e-4, and so is the mean over pairs; TRL's float32 logsigmoid and mean add
a few u: TOL_LOSS = 2.5e-4. Measured: 8e-8 on the loss, 3e-6 on the sums (printed).

Negative controls, each failing the comparison by more than 10 x its tolerance: the EOS left
untrained (a format mismatch: TRL trains the EOS it appends), and the row run as one causal
sequence (boundaries dropped). Skipped only when TRL is not installed (``pytest.importorskip``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from sftpack import PackedBatch, Sample
from sftpack.chat import tokenize_pair
from sftpack.exactness import packed_text_logits, tiny_llama
from sftpack.loss import sequence_logprob_sums
from sftpack.objectives import count_pairs, dpo_loss, pair_mean, pairs_of
from sftpack.sample import pair_meta, pair_sequence_id
from sftpack.testing import tiny_chat_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

F64 = torch.float64
BETA = 0.1
Z = 4.0  # |logit| bound, asserted
MAX_TARGETS = 16  # trained tokens per sequence, asserted
TOL_SUM = 6e-4  # see the docstring
TOL_LOSS = 2.5e-4
ROWS = [
    {"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"},
    {"prompt": "hello there", "chosen": " hi, how are you", "rejected": " no"},
    {"prompt": "the cat sat on", "chosen": " the mat", "rejected": " a hat today"},
]


@functools.cache
def tokenizer():
    return tiny_chat_tokenizer("chatml")


def trainer(tmp: str):
    """A real DPOTrainer: TRL prepares the data, builds the collator and patches both models'
    forward with its fused LM head."""
    tok = tokenizer()
    args = trl.DPOConfig(
        output_dir=tmp,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=len(ROWS),
        beta=BETA,
        loss_type=["sigmoid"],
        disable_dropout=True,
    )
    return trl.DPOTrainer(
        model=tiny_llama(len(tok), seed=0, dtype=F64),
        ref_model=tiny_llama(len(tok), seed=1, dtype=F64),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tok,
    )


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    return trainer(str(tmp_path_factory.mktemp("trl")))


def trl_batch(tr) -> dict:
    return tr.data_collator([tr.train_dataset[i] for i in range(len(ROWS))])


def trl_sequence_logps(model, batch: dict) -> torch.Tensor:
    """``(2B,)`` summed log-probabilities of the completions, from TRL's fused forward
    (chosen first, then rejected, as TRL lays its batch)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=labels,
            fused_lm_head=True,
            use_cache=False,
        )
    return out.log_probs.sum(dim=1)


def sft_samples(*, untrained_eos: bool = False) -> list[Sample]:
    """The pairs through sftpack's tokenizer, each member's id its ``(group, role)``; in the row's
    order: partners apart."""
    members = []
    for k, row in enumerate(ROWS):
        for s in tokenize_pair(row, tokenizer(), conversation_id=k):
            mask = s.loss_mask.copy()
            if untrained_eos:
                mask[-1] = False
            members.append(dataclasses.replace(s, loss_mask=mask, conversation_id=pair_sequence_id(s)))
    # chosen of pair k at 2k, rejected at 2k + 1: rejected ones rotated so partners are apart
    chosen, rejected = members[0::2], members[1::2]
    return [x for pair in zip(chosen, rejected[1:] + rejected[:1]) for x in pair]


def sft_packed(tr, *, untrained_eos: bool = False, boundaries: bool = True) -> dict:
    """sftpack's DPO loss of the pairs: one packed forward per model."""
    row = PackedBatch.from_samples(sft_samples(untrained_eos=untrained_eos), pad_multiple=4).validate()
    assert int((row.padded_seqlens - row.seqlens).max()) > 0  # padding between the sequences

    def logits(model) -> torch.Tensor:
        if boundaries:
            return packed_text_logits(model, row, pad_between_seqs=False)
        ones = torch.ones(1, row.num_tokens, dtype=torch.long)  # one causal run over the whole row
        pos = row.position_ids[None]
        return model(input_ids=row.input_ids[None], position_ids=pos, attention_mask=ones, use_cache=False).logits[0]

    with torch.no_grad():
        pol, ref = logits(tr.model), logits(tr.ref_model)
        lp, counts = sequence_logprob_sums(pol, row)
        rp, _ = sequence_logprob_sums(ref, row)
        ids = row.sequence_ids or ()
        pairs = pairs_of(row, pair_meta(ids))
        out = dpo_loss(lp[pairs.chosen], lp[pairs.rejected], rp[pairs.chosen], rp[pairs.rejected], beta=BETA)
        loss = pair_mean(out.losses, count_pairs(pairs, group=False))
    return {
        "loss": loss,
        "logps": dict(zip(ids, lp)),
        "counts": dict(zip(ids, counts.tolist())),
        "max_logit": float(max(pol.abs().max(), ref.abs().max())),
    }


def test_trl_tokenizes_the_strings_as_sftpack_does(dpo):
    """TRL's string rule (the prompt's tokens, then the answer's and EOS, the answer trained) is
    sftpack's: the same ids and the same trained tokens, for every member of every pair."""
    for k, row in enumerate(ROWS):
        ex = dpo.train_dataset[k]
        chosen, rejected = tokenize_pair(row, tokenizer(), conversation_id=k)
        for s, answer in ((chosen, ex["chosen_ids"]), (rejected, ex["rejected_ids"])):
            assert s.input_ids.tolist() == ex["prompt_ids"] + answer
            assert s.loss_mask.tolist() == [False] * len(ex["prompt_ids"]) + [True] * len(answer)
        assert ex["chosen_ids"][-1] == tokenizer().eos_token_id  # TRL appends EOS and trains it


def differences(tr, ours: dict) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """``(|d loss|, max |d sum|, TRL's loss, TRL's policy-minus-reference sums)`` between sftpack's
    packed result ``ours`` and TRL: its per-sequence log-probabilities from its fused LM head (the
    forward ``compute_loss`` runs; chosen of every pair, then rejected), and its own loss,
    ``compute_loss`` over its padded ``[2B, S]`` batch through both models."""
    batch = trl_batch(tr)
    pol, ref = trl_sequence_logps(tr.model, batch), trl_sequence_logps(tr.ref_model, batch)
    ids = [(k, "chosen") for k in range(len(ROWS))] + [(k, "rejected") for k in range(len(ROWS))]
    want = dict(zip(ids, pol.tolist()))
    d_sums = max(abs(float(ours["logps"][i]) - want[i]) for i in ids)
    with torch.no_grad():
        theirs = tr.compute_loss(tr.model, batch)
    return abs(float(ours["loss"]) - float(theirs)), d_sums, theirs, pol - ref


def test_packed_dpo_loss_equals_trls(dpo):
    ours = sft_packed(dpo)
    assert ours["max_logit"] <= Z and max(ours["counts"].values()) <= MAX_TARGETS  # the premises of the TOLs
    d_loss, d_sums, theirs, ratios = differences(dpo, ours)
    print(
        f"TRL {float(theirs):.9f} sftpack {float(ours['loss']):.12f}: |d loss| {d_loss:.2e}, max |d sum| {d_sums:.2e}"
    )
    assert d_sums <= TOL_SUM, d_sums  # written so that a NaN fails
    assert d_loss <= TOL_LOSS, d_loss
    # not a vacuous match: the two models differ, so the loss is away from ln 2 (every margin 0)
    assert abs(float(theirs) - np.log(2)) > 10 * TOL_LOSS
    assert float(ratios.abs().min()) > 10 * TOL_SUM


@pytest.mark.parametrize("control", ["EOS untrained", "boundaries dropped"])
def test_negative_controls_fail_the_comparison(dpo, control):
    """Each control breaks the comparison above by more than 10 x its tolerance: the loss for the
    untrained EOS, the per-sequence sums for dropped boundaries (the loss, a mean of three pairs,
    moves by only ~2 x TOL_LOSS there: TOL_LOSS is a worst-case float32 bound)."""
    bad = sft_packed(dpo, untrained_eos=control == "EOS untrained", boundaries=control != "boundaries dropped")
    d_loss, d_sums, _, _ = differences(dpo, bad)
    print(
        f"negative control {control}: |d loss| {d_loss / TOL_LOSS:.1f} x TOL_LOSS, max |d sum| {d_sums / TOL_SUM:.1f} x TOL_SUM"
    )
    assert max(d_loss / TOL_LOSS, d_sums / TOL_SUM) > 10
