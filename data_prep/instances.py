"""The reference's training instances of one text file, compiled, draw for draw.

MLCommons create_pretraining_data.py, per input file, with one `random.Random(seed)`:
1. shuffle the documents;
2. dupe_factor times, for every document in the shuffled order, make its instances:
   - target length: max_seq_length - 3, or with probability short_seq_prob randint(2, that);
   - gather sentences into a chunk until it holds >= target tokens or the document ends;
     A is the chunk's first a_end sentences (randint(1, sentences - 1), or 1 for a
     one-sentence chunk);
   - B is the rest of the chunk, unless the chunk has one sentence or random() < 0.5: then B
     is read from a random other document (randint, up to 10 tries to avoid this one) from a
     random sentence on, until it holds >= target - len(A) tokens, and the chunk's unused
     sentences go back to the document;
   - truncate: while len(A) + len(B) > max_seq_length - 3, the longer side (B on ties) loses
     its first token if random() < 0.5, else its last;
   - mask [CLS] A [SEP] B [SEP]: shuffle the positions that are not [CLS]/[SEP], take the
     first min(max_predictions, max(1, round(n * masked_lm_prob))) of that shuffled order and,
     for each in that order, [MASK] if random() < 0.8, else keep it if random() < 0.5, else a
     vocabulary entry randint(0, V - 1); positions are then sorted;
3. shuffle all instances.

Here the documents are flat token arrays (text.TokenizedText), A and B are token spans (the
sentences of one document are contiguous), and every draw comes from mt19937's rendering
of the same generator, in the same order. `make_instances` holds a file's instances as
spans and masks (~0.5 KB each), and `fixed_rows` expands any subset to the padded arrays.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numba
import numpy as np

from data_prep import mt19937 as mt
from mlperf_bert.data.shards import STORAGE_DTYPES
from data_prep.text import TokenizedText

# Columns of the [n, 5] span table.
A_START, A_END, B_START, B_END, IS_RANDOM = range(5)


@dataclass(frozen=True)
class InstanceParams:
    """create_pretraining_data.py's flags, and the ids its masking needs."""

    max_seq_length: int
    max_predictions: int
    masked_lm_prob: float
    short_seq_prob: float
    dupe_factor: int
    vocab_size: int
    cls_id: int
    sep_id: int
    mask_id: int


@dataclass
class Instances:
    """N instances in creation order, and `order`: the reference's output order (its final shuffle).

    Output row i is instance order[i]; the arrays are not permuted, which saves a copy.
    """

    spans: np.ndarray  # [N, 5] int64 token spans of A and B after truncation, is_random
    num_predictions: np.ndarray  # [N] int64
    positions: np.ndarray  # [N, P] int16 masked positions, ascending, 0 after num_predictions
    labels: np.ndarray  # [N, P] int16 original ids at them
    replacements: np.ndarray  # [N, P] int16 ids written at them ([MASK], the original, or random)
    order: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return int(self.spans.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return self.spans[:, A_END] - self.spans[:, A_START] + self.spans[:, B_END] - self.spans[:, B_START] + 3


@numba.njit(cache=True, nogil=True)
def _grow(array: np.ndarray, needed: int) -> np.ndarray:
    if needed <= array.shape[0]:
        return array
    bigger = np.zeros((max(needed, array.shape[0] * 3 // 2),) + array.shape[1:], array.dtype)
    bigger[: array.shape[0]] = array
    return bigger


@numba.njit(cache=True, nogil=True)
def _truncate(span: np.ndarray, max_num_tokens: int, words: np.ndarray, position: np.ndarray) -> None:
    """truncate_seq_pair on span [a_start, a_end, b_start, b_end], one draw per dropped token."""
    while span[1] - span[0] + span[3] - span[2] > max_num_tokens:
        side = 0 if span[1] - span[0] > span[3] - span[2] else 2
        if mt.random_float(words, position) < 0.5:
            span[side] += 1
        else:
            span[side + 1] -= 1


@numba.njit(cache=True, nogil=True)
def _random_b(order, sentence_starts, doc_starts, doc_index, target_b, words, position):
    """Token span of B read from a random other document, as the reference picks it."""
    other = doc_index
    for _ in range(10):
        other = mt.randint(words, position, 0, order.shape[0] - 1)
        if other != doc_index:
            break
    first, stop = doc_starts[order[other]], doc_starts[order[other] + 1]
    start = first + mt.randint(words, position, 0, stop - first - 1)
    end = start + 1
    while end < stop and sentence_starts[end] - sentence_starts[start] < target_b:
        end += 1
    return sentence_starts[start], sentence_starts[end]


@numba.njit(cache=True, nogil=True)
def _mask(sequence, masked_lm_prob, ids, positions, labels, replacements, scratch, words, position) -> int:
    """Masks one sequence; fills the row's positions/labels/replacements, returns their count.

    `scratch` is [2, max_seq_length] int64 work space, all zero in row 1 between calls.
    """
    vocab_size, cls_id, sep_id, mask_id = ids[0], ids[1], ids[2], ids[3]
    n = sequence.shape[0]
    candidates, chosen = scratch[0], scratch[1]
    count = 0
    for i in range(n):
        if sequence[i] != cls_id and sequence[i] != sep_id:
            candidates[count] = i
            count += 1
    mt.shuffle(words, position, candidates[:count])
    wanted = min(positions.shape[0], max(1, int(np.rint(n * masked_lm_prob))))  # rint: round half to even
    taken = min(wanted, count)
    for k in range(taken):
        index = candidates[k]
        if mt.random_float(words, position) < 0.8:
            chosen[index] = mask_id + 1
        elif mt.random_float(words, position) < 0.5:
            chosen[index] = sequence[index] + 1
        else:
            chosen[index] = mt.randint(words, position, 0, vocab_size - 1) + 1
    # The reference sorts its predictions by position: read them back in position order.
    out = 0
    for i in range(n):
        if chosen[i]:
            positions[out], labels[out], replacements[out] = i, sequence[i], chosen[i] - 1
            chosen[i] = 0
            out += 1
    return taken


@numba.njit(cache=True, nogil=True)
def _sequence(tokens, span, cls_id, sep_id, buffer):
    """[CLS] A [SEP] B [SEP] of `span`, written into `buffer` (returns the used part)."""
    la, lb = span[1] - span[0], span[3] - span[2]
    sequence = buffer[:la + lb + 3]
    sequence[0] = cls_id
    sequence[1:la + 1] = tokens[span[0]:span[1]]
    sequence[la + 1] = sep_id
    sequence[la + 2:la + lb + 2] = tokens[span[2]:span[3]]
    sequence[la + lb + 2] = sep_id
    return sequence


@numba.njit(cache=True, nogil=True)
def _document(doc_index, order, tokens, sentence_starts, doc_starts, max_seq_length, short_seq_prob, masked_lm_prob,
              ids, out, n, work, words, position):
    """Instances of one document (create_instances_from_document), written to `out` from row n.

    `out` = (spans, counts, positions, labels, replacements) has room for one instance per
    sentence of the document; returns the new row count.
    """
    spans, counts, positions, labels, replacements = out
    max_num_tokens = max_seq_length - 3
    first, stop = doc_starts[order[doc_index]], doc_starts[order[doc_index] + 1]
    target = max_num_tokens
    if mt.random_float(words, position) < short_seq_prob:
        target = mt.randint(words, position, 2, max_num_tokens)
    chunk_start, chunk_size, i = first, 0, first
    while i < stop:
        chunk_size += 1
        if i == stop - 1 or sentence_starts[i + 1] - sentence_starts[chunk_start] >= target:
            a_end = 1
            if chunk_size >= 2:
                a_end = mt.randint(words, position, 1, chunk_size - 1)
            span = spans[n]
            span[0], span[1] = sentence_starts[chunk_start], sentence_starts[chunk_start + a_end]
            if chunk_size == 1 or mt.random_float(words, position) < 0.5:
                span[2], span[3] = _random_b(order, sentence_starts, doc_starts, doc_index,
                                             target - (span[1] - span[0]), words, position)
                span[4] = 1
                i -= chunk_size - a_end  # the chunk's unused sentences go back to the document
            else:
                span[2], span[3] = span[1], sentence_starts[chunk_start + chunk_size]
            _truncate(span, max_num_tokens, words, position)
            sequence = _sequence(tokens, span, ids[1], ids[2], work[0])
            counts[n] = _mask(sequence, masked_lm_prob, ids, positions[n], labels[n], replacements[n], work[1:],
                              words, position)
            n += 1
            chunk_start, chunk_size = i + 1, 0
        i += 1
    return n


@numba.njit(cache=True, nogil=True)
def _generate(tokens, sentence_starts, doc_starts, max_seq_length, short_seq_prob, dupe_factor, max_predictions,
              masked_lm_prob, ids, words, position):
    """(spans [N, 5], counts [N], positions, labels, replacements [N, P]) in creation order."""
    num_docs = doc_starts.shape[0] - 1
    order = np.arange(num_docs)
    mt.shuffle(words, position, order)
    # Measured: one instance per ~0.45 max_seq_length tokens per round (random-next pairs hand
    # sentences back); start a little above that, _grow adds half when short.
    capacity = max(16, int(2.5 * dupe_factor * tokens.shape[0] / max_seq_length))
    spans = np.zeros((capacity, 5), np.int64)
    counts = np.zeros(capacity, np.int64)
    positions = np.zeros((capacity, max_predictions), np.int16)
    labels = np.zeros((capacity, max_predictions), np.int16)  # ids fit: vocab.py allows <= 32,767 entries
    replacements = np.zeros((capacity, max_predictions), np.int16)
    work = np.zeros((3, max_seq_length), np.int64)  # the sequence, then _mask's scratch rows
    n = 0
    for _ in range(dupe_factor):
        for doc_index in range(num_docs):
            room = n + doc_starts[order[doc_index] + 1] - doc_starts[order[doc_index]]  # <= 1 per sentence
            spans, counts, positions = _grow(spans, room), _grow(counts, room), _grow(positions, room)
            labels, replacements = _grow(labels, room), _grow(replacements, room)
            n = _document(doc_index, order, tokens, sentence_starts, doc_starts, max_seq_length, short_seq_prob,
                          masked_lm_prob, ids, (spans, counts, positions, labels, replacements), n, work, words,
                          position)
    return spans[:n], counts[:n], positions[:n], labels[:n], replacements[:n]


@numba.njit(cache=True, nogil=True)
def _final_order(n, words, position):
    order = np.arange(n)
    mt.shuffle(words, position, order)
    return order


def make_instances(text: TokenizedText, params: InstanceParams, rng: random.Random) -> Instances:
    """A file's instances in the reference's output order; `rng` continues after the file's draws."""
    words, position = mt.twister_from(rng)
    ids = np.array([params.vocab_size, params.cls_id, params.sep_id, params.mask_id], np.int64)
    spans, counts, positions, labels, replacements = _generate(
        text.tokens, text.sentence_starts, text.document_starts, params.max_seq_length, params.short_seq_prob,
        params.dupe_factor, params.max_predictions, params.masked_lm_prob, ids, words, position)
    order = _final_order(spans.shape[0], words, position)
    rng.setstate(mt.to_random(words, position).getstate())
    return Instances(spans, counts, positions, labels, replacements, order)


@numba.njit(cache=True, nogil=True)
def _fill(tokens, spans, counts, positions, replacements, cls_id, sep_id, input_ids, input_mask, segment_ids):
    buffer = np.empty(input_ids.shape[1], np.int64)
    for row in range(spans.shape[0]):
        sequence = _sequence(tokens, spans[row], cls_id, sep_id, buffer)
        n, la = sequence.shape[0], spans[row, 1] - spans[row, 0]
        input_ids[row, :n] = sequence
        input_mask[row, :n] = 1
        segment_ids[row, la + 2:n] = 1
        for k in range(counts[row]):
            input_ids[row, positions[row, k]] = replacements[row, k]


def fixed_rows(tokens: np.ndarray, instances: Instances, rows: slice, params: InstanceParams) -> dict[str, np.ndarray]:
    """The padded MLCommons arrays (as the reference's TFRecords hold them) of output rows `rows`."""
    picked = instances.order[rows]
    spans, counts = instances.spans[picked], instances.num_predictions[picked]
    n, length = spans.shape[0], params.max_seq_length
    out = {key: np.zeros((n, length), STORAGE_DTYPES[key]) for key in ("input_ids", "input_mask", "segment_ids")}
    _fill(tokens, spans, counts, instances.positions[picked], instances.replacements[picked], params.cls_id,
          params.sep_id, out["input_ids"], out["input_mask"], out["segment_ids"])
    out["masked_lm_positions"] = instances.positions[picked].astype(STORAGE_DTYPES["masked_lm_positions"])
    out["masked_lm_ids"] = instances.labels[picked].astype(STORAGE_DTYPES["masked_lm_ids"])
    out["next_sentence_labels"] = spans[:, IS_RANDOM].astype(STORAGE_DTYPES["next_sentence_labels"])
    return out
