"""Our flat-token BERT against HuggingFace `BertForPreTraining` holding the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from mlperf_bert.data.batch import FlatBatch, Sample, flatten_items, pad_items, unpad
from mlperf_bert.model.init_checkpoint import adapt_state_dict
from mlperf_bert.model.bert import BertConfig, BertForPreTraining, pretraining_loss

VOCAB = 101  # deliberately not a multiple of 8: exercises the padded embedding
MAX_LEN = 24
MAX_PRED = 5


def tiny_config() -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=MAX_LEN,
    )


def hf_model(cfg: BertConfig) -> transformers.BertForPreTraining:
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=cfg.max_position_embeddings,
        layer_norm_eps=cfg.layer_norm_eps,
    )
    torch.manual_seed(0)
    hf_cfg._attn_implementation = "eager"
    model = transformers.BertForPreTraining(hf_cfg)
    # Random non-trivial weights everywhere, biases and LayerNorms included.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def ours_from(hf: transformers.BertForPreTraining, cfg: BertConfig) -> BertForPreTraining:
    model = BertForPreTraining(cfg)
    model.load_state_dict(adapt_state_dict(dict(hf.state_dict()), model, "hf"))
    return model.eval()


def random_sample(rng: np.random.Generator, length: int) -> Sample:
    ids = rng.integers(5, VOCAB, size=length)
    segments = np.zeros(length, dtype=np.int64)
    segments[length // 2 :] = 1
    k = int(rng.integers(1, min(MAX_PRED, length - 1) + 1))
    positions = np.sort(rng.choice(np.arange(1, length), size=k, replace=False))
    return Sample(ids, segments, positions, rng.integers(5, VOCAB, size=k), int(rng.integers(0, 2)))


def hf_inputs(samples: list[Sample]) -> dict[str, torch.Tensor]:
    padded = pad_items([(s,) for s in samples], MAX_LEN, MAX_PRED)
    labels = torch.full_like(padded.input_ids, -100)
    for i, s in enumerate(samples):
        labels[i, torch.from_numpy(s.masked_lm_positions)] = torch.from_numpy(s.masked_lm_ids)
    return dict(
        input_ids=padded.input_ids,
        attention_mask=padded.input_mask,
        token_type_ids=padded.segment_ids,
        labels=labels,
        next_sentence_label=padded.next_sentence_labels,
    )


def hf_masked_logits(out, samples: list[Sample]) -> torch.Tensor:
    rows = [out.prediction_logits[i, torch.from_numpy(s.masked_lm_positions)] for i, s in enumerate(samples)]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    hf = hf_model(cfg)
    return cfg, hf, ours_from(hf, cfg)


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    rng = np.random.default_rng(1)
    return [random_sample(rng, n) for n in (24, 7, 15, 3, 19)]


def rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 0.0) -> None:
    scale = b.abs().max().clamp_min(1e-12)
    assert ((a - b).abs().max() / scale).item() < rtol or (a - b).abs().max().item() < atol


def test_padded_batch_matches_huggingface(models, samples):
    cfg, hf, ours = models
    with torch.no_grad():
        ref = hf(**hf_inputs(samples))
        batch = unpad(pad_items([(s,) for s in samples], MAX_LEN, MAX_PRED))
        out = ours(batch)
        loss = pretraining_loss(out, batch)
    rel_close(out.mlm_logits, hf_masked_logits(ref, samples))
    rel_close(out.nsp_logits, ref.seq_relationship_logits)
    assert abs(loss.total.item() - ref.loss.item()) / ref.loss.item() < 1e-5


def test_unpadded_batch_equals_unpadded_padded_batch(samples):
    padded = unpad(pad_items([(s,) for s in samples], MAX_LEN, MAX_PRED))
    flat = flatten_items([(s,) for s in samples])
    for name in ("input_ids", "segment_ids", "position_ids", "cu_seqlens", "masked_positions", "masked_lm_ids"):
        assert torch.equal(getattr(padded, name), getattr(flat, name)), name
    assert padded.max_seqlen == flat.max_seqlen


def packed_row(parts: list[Sample], row_len: int) -> FlatBatch:
    """One packed row as the packed layout stores it: sequences back to back, row positions."""
    lengths = [s.length for s in parts]
    starts = np.cumsum([0] + lengths[:-1])
    row_positions = np.concatenate([s.masked_lm_positions + o for s, o in zip(parts, starts)])
    assert sum(lengths) <= row_len
    return FlatBatch(
        input_ids=torch.from_numpy(np.concatenate([s.input_ids for s in parts])),
        segment_ids=torch.from_numpy(np.concatenate([s.segment_ids for s in parts])),
        position_ids=torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])),
        cu_seqlens=torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32),
        max_seqlen=max(lengths),
        masked_positions=torch.from_numpy(row_positions),
        masked_lm_ids=torch.from_numpy(np.concatenate([s.masked_lm_ids for s in parts])),
        next_sentence_labels=torch.tensor([s.next_sentence_label for s in parts]),
    )


def test_packed_row_gives_per_sequence_values_of_sequences_run_alone(models, samples):
    _, hf, ours = models
    parts = samples[1:4]  # 7 + 15 + 3 tokens in one 25-token row
    with torch.no_grad():
        packed = ours(packed_row(parts, MAX_LEN + 1))
        alone_mlm, alone_nsp = [], []
        for s in parts:
            ref = hf(**hf_inputs([s]))
            alone_mlm.append(hf_masked_logits(ref, [s]))
            alone_nsp.append(ref.seq_relationship_logits)
    rel_close(packed.mlm_logits, torch.cat(alone_mlm))
    rel_close(packed.nsp_logits, torch.cat(alone_nsp))


def test_gradients_match_huggingface(models, samples):
    cfg, hf, _ = models
    ours = ours_from(hf, cfg)
    hf.zero_grad()
    hf(**hf_inputs(samples)).loss.backward()
    batch = unpad(pad_items([(s,) for s in samples], MAX_LEN, MAX_PRED))
    pretraining_loss(ours(batch), batch).total.backward()
    hf_grads = dict(hf.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        ref = hf_grads[name].grad
        grad = p.grad[: ref.shape[0]] if name in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias") else p.grad
        # The key bias gets an exactly-zero gradient (softmax is shift invariant): an
        # absolute floor keeps round-off at 1e-10 from counting as a mismatch.
        rel_close(grad, ref, rtol=1e-4, atol=1e-8)
        checked += 1
    assert checked == len(list(ours.parameters())) > 30


def test_vocab_padding_rows_never_reach_the_logits(models):
    cfg, _, ours = models
    assert ours.bert.embeddings.word_embeddings.weight.shape[0] == 104
    rng = np.random.default_rng(3)
    batch = flatten_items([(random_sample(rng, 10),)])
    with torch.no_grad():
        assert ours(batch).mlm_logits.shape[1] == VOCAB
