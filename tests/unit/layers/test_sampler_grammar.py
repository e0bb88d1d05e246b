"""Grammar masks in the sampler: constrained rows only ever get an allowed token, greedy or
sampled, in the same batch as unconstrained rows, which are left alone; a mask that leaves
nothing but a suppressed id keeps the grammar's tokens; masked logprobs stay finite."""

from __future__ import annotations

import torch

from cadence.constrained.base import Grammar
from cadence.io_struct import SamplingParams
from cadence.layers.sampler import LOGPROB_FLOOR, SamplingInput, sample

VOCAB = 100


class SetGrammar(Grammar):
    """Allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed
        self.fills = 0

    def fill_mask(self, bitmask, row):
        self.fills += 1
        bitmask[row] = 0
        for t in self.allowed:
            word, bit = divmod(t, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept(self, token_id):
        return token_id in self.allowed

    def is_terminated(self):
        return False


def row(grammar=None, suppress=None, **params) -> SamplingInput:
    return SamplingInput(SamplingParams(**params), [1], [], None, suppress, grammar=grammar)


def test_constrained_rows_get_allowed_tokens_beside_free_rows():
    logits = torch.randn(4, VOCAB)
    logits[:, 7] = 50.0  # every row's favourite
    allowed = {3, 31, 32, 63, 64, 99}  # word edges and the last token
    rows = [
        row(SetGrammar(allowed), temperature=0),
        row(temperature=0),
        row(SetGrammar(allowed), temperature=1.0),
        row(SetGrammar({99}), temperature=0.7, top_p=0.5),
    ]
    for _ in range(20):
        out = sample(logits, rows)
        assert out.next_ids[0] in allowed and out.next_ids[2] in allowed
        assert out.next_ids[1] == 7 and out.next_ids[3] == 99
    assert out.next_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert logits[0, 7] == 50.0  # the caller's logits are untouched


def test_a_suppressed_only_token_yields_to_the_grammar():
    logits = torch.zeros(2, VOCAB)
    rows = [
        row(SetGrammar({5}), suppress=[5], temperature=0),  # EOS before min_new_tokens
        row(SetGrammar({5, 6}), suppress=[5], temperature=0),
    ]
    assert sample(logits, rows).next_ids == [5, 6]


def test_masked_logprobs_are_floored_not_infinite():
    logits = torch.randn(1, VOCAB)
    r = row(SetGrammar({4}), temperature=0)
    r.return_logprob, r.top_logprobs_num = True, 3
    out = sample(logits, [r])
    assert out.next_ids == [4] and abs(out.logprobs[0]) < 1e-5
    assert [lp for lp, _ in out.top_logprobs[0][1:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
