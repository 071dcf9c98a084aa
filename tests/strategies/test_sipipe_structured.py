"""structured_outputs in SiPipe's column samplers: each constrained column's grammar follows its
reply in the replica's buffers through joins, moves, leavers and trims (the churn the other
column-sampler tests replay), so every reply stays inside its grammar and the tokens are the
engine's default sampler's; end to end, a PP=2 SiPipe engine gives the single process's replies."""
from __future__ import annotations

import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from batchinfer.engine.kernels import load_native_kernels  # noqa: E402
from batchinfer.engine.request import SamplingParams  # noqa: E402
from batchinfer.engine.sampler import Sampler  # noqa: E402
from batchinfer.engine.structured_output import compiled_grammar  # noqa: E402
from batchinfer.strategies.sipipe.column_sampler import ColumnSampler  # noqa: E402
from batchinfer.strategies.sipipe.columns import ColumnAssigner  # noqa: E402
from tests.sipipe_churn import churn, pp2_and_single_process, sample_columns  # noqa: E402

GRAMMARS = [{"choice": ["red", "green", "blue violet"]},
            {"regex": r"[a-z]{2,5}-[0-9]{1,3}"},
            {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"]}}]
PARAMS = [SamplingParams(temperature=0.0, structured_outputs=GRAMMARS[0]),
          SamplingParams(temperature=1.0, structured_outputs=GRAMMARS[1]),
          SamplingParams(temperature=0.8, top_k=20, structured_outputs=GRAMMARS[2]),
          SamplingParams(temperature=0.9)]                               # unconstrained


@pytest.fixture(scope="module")
def vocabulary(default_model_dir):
    from batchinfer.engine.tokenizer import _hf_tokenizer, _version

    path = default_model_dir.resolve()
    hf = _hf_tokenizer(str(path), _version(path))
    return str(path), len(hf), (hf.eos_token_id,)


def inside_its_grammar(source: str, vocab: int, seq) -> bool:
    """A fresh matcher takes the whole reply (up to the grammar's end)."""
    sampling = seq.request.sampling
    matcher = xgr.GrammarMatcher(compiled_grammar(source, vocab, sampling.structured_outputs))
    for token in seq.output_token_ids:
        if matcher.is_terminated():
            return True
        if not matcher.accept_token(token):
            return False
    return True


def test_column_grammars_follow_the_churn(vocabulary):
    source, vocab, eos = vocabulary
    native = load_native_kernels()
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    default = Sampler(vocab, eos, torch.device("cpu"), native_kernels=native,
                      tokenizer_source=source)
    replicas = [(ColumnAssigner(16), ColumnSampler(vocab, 16, 256, eos, native, source))
                for _ in range(2)]
    seen = {}
    for step, r, batch, rows, seqs in churn(vocab, rng, PARAMS, steps=40):
        assigner, sampler = replicas[r]
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        expected, _ = default.sample(logits.clone(), default.prepare(rows))
        cols, tokens, _ = sample_columns(assigner, sampler, batch, rows, seqs, logits, vocab)
        got = [tokens[c] for c in cols]
        if native:                  # the column kernels are the row kernels' arithmetic
            assert got == expected.tolist(), f"step {step}"
        for seq, token in zip(rows, got):
            seq.output_token_ids.append(token)
            seen[seq.request_id] = seq
        assert len(sampler.grammars) <= len(tokens)   # a token per column; leavers' grammars are dropped
    constrained = [s for s in seen.values() if s.request.sampling.structured_outputs]
    assert len(constrained) > 5
    for seq in constrained:
        assert inside_its_grammar(source, vocab, seq), seq.request_id


@pytest.mark.slow
def test_sipipe_structured_replies_equal_the_single_process(make_engine):
    prompts = ["Pick a colour:", "A code like ab-12:", "Some JSON:", "Hi"]
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=GRAMMARS[0]),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                             structured_outputs=GRAMMARS[1]),
              SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=GRAMMARS[2]),
              SamplingParams(max_tokens=8, temperature=0.0)]
    outs, reference = pp2_and_single_process(make_engine, prompts, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    assert outs[0].text in ("red", "green", "blue violet")
