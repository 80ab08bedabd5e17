"""KV-cache generation equals recomputing the whole sequence at every step, and a left-padded batch of prompts
equals each prompt alone."""

import pytest
import torch

from glm46.modules import KVCache

from .helpers import random_model, tiny_config


def generate_without_cache(model, x, steps, temperature=0.0, generator=None):
    from glm46.modules.generation import sample_next_token

    for _ in range(steps):
        logits = model(x).logits[:, -1]
        x = torch.cat([x, sample_next_token(logits, temperature, top_k=20, top_p=0.9, generator=generator)[:, None]], 1)
    return x


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(vocab_size=96))


def test_greedy_generation_equals_full_recomputation(model):
    x = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = generate_without_cache(model, x, 12)
    got = model.generate(x, max_new_tokens=12)
    assert torch.equal(got, expected)


def test_sampling_with_cache_equals_sampling_without(model):
    x = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = generate_without_cache(model, x, 10, temperature=1.3, generator=torch.Generator().manual_seed(7))
    got = model.generate(x, 10, temperature=1.3, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, expected)
    assert not torch.equal(got, model.generate(x, 10)), "sampling at temperature 1.3 should differ from greedy"


def test_cached_logits_equal_full_sequence_logits_chunk_by_chunk(model):
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config, batch_size=2, max_len=16, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        full = model(x).logits
        chunks = [model(x[:, a:b], cache=cache).logits for a, b in ((0, 5), (5, 6), (6, 13), (13, 16))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 16


def test_generation_stops_at_eos_and_pads_with_it(model):
    x = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(3))
    free = model.generate(x, 8)
    eos = int(free[0, 6])  # the token row 0 emits third
    out = model.generate(x, 8, eos_token_id=eos)
    first = (out[0, 4:] == eos).nonzero()[0].item() + 4
    assert (out[0, first:] == eos).all()
    assert torch.equal(out[:, : first + 1], free[:, : first + 1])


def test_cache_overflow_is_refused(model):
    cache = KVCache(model.config, batch_size=1, max_len=4, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="max_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


LENGTHS = (3, 7, 5, 9)


def left_pad(prompts: list[torch.Tensor], pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [n_i] -> input_ids, attention_mask [B, max n_i], each prompt at the right of its row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


def random_prompts(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=generator) for n in LENGTHS]


def test_left_padded_greedy_generation_equals_each_prompt_alone(model):
    prompts = random_prompts(4)
    ids, mask = left_pad(prompts)
    width = ids.shape[1]
    seen = []  # the position ids of every forward, through the rotary embedding
    hook = model.model.rotary_emb.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        got = model.generate(ids, 10, attention_mask=mask)
    finally:
        hook.remove()
    alone = [model.generate(p[None], 10)[0] for p in prompts]
    for row, p, single in zip(got, prompts, alone):
        assert torch.equal(row[width:], single[len(p) :])
    # Positions count from each row's first real token (pads at 0) and grow by one per generated token.
    assert torch.equal(seen[0], torch.tensor([[0] * (width - n) + list(range(n)) for n in LENGTHS]))
    for step, positions in enumerate(seen[1:]):
        assert torch.equal(positions, torch.tensor(LENGTHS)[:, None] + step)
    unmasked = model.generate(ids, 10)
    padded_rows = [row for row, n in enumerate(LENGTHS) if n < width]
    assert not torch.equal(unmasked[padded_rows], got[padded_rows]), "without the mask pads should change the output"

    eos = int(got[0, width + 2])  # the token row 0 emits third
    stopped = model.generate(ids, 10, eos_token_id=eos, attention_mask=mask)
    for row, p in zip(stopped, prompts):
        single = model.generate(p[None], 10, eos_token_id=eos)[0, len(p) :]
        assert torch.equal(row[width : width + len(single)], single)
        assert (row[width + len(single) :] == eos).all()  # a row that stopped is padded with EOS
    finished_early = (stopped[:, width:-1] == eos).any(dim=1)
    assert finished_early[0] and not finished_early.all(), "the test needs rows that stop early and rows that run on"


def padded_logits(model, ids, mask, continuation, mark_padding=True) -> torch.Tensor:
    """Logits [B, T + C, V] of left-padded prompts ids [B, T] then continuation [B, C], fed through the KV cache as
    the prompt, a chunk of 3 tokens and then one token at a time (decoding)."""
    from glm46.modules.model import left_padded_positions

    cache = KVCache(model.config, ids.shape[0], ids.shape[1] + continuation.shape[1], torch.float32, ids.device)
    if mark_padding:
        cache.mark_padding(mask)
    positions = left_padded_positions(mask)
    logits = [model(ids, position_ids=positions, cache=cache).logits]
    after = positions[:, -1:] + 1  # [B, 1] each row's next position
    for a, b in [(0, 3), *((i, i + 1) for i in range(3, continuation.shape[1]))]:
        logits.append(model(continuation[:, a:b], position_ids=after + torch.arange(a, b), cache=cache).logits)
    return torch.cat(logits, dim=1)


def test_left_padded_cached_logits_equal_each_sequence_alone(model):
    prompts = random_prompts(5)
    ids, mask = left_pad(prompts)
    continuation = torch.randint(0, 96, (len(prompts), 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        batched = padded_logits(model, ids, mask, continuation)
        unmasked = padded_logits(model, ids, mask, continuation, mark_padding=False)
        for row, p in enumerate(prompts):
            alone = model(torch.cat([p, continuation[row]])[None]).logits[0]  # no cache: the full-sequence path
            start = ids.shape[1] - len(p)
            torch.testing.assert_close(batched[row, start:], alone, rtol=1e-5, atol=1e-5)
            if start > 0:  # attending to the pads changes the logits of a padded row
                assert (unmasked[row, start:] - alone).abs().max() > 1e-2
    assert batched.isfinite().all(), "pad queries must not produce NaN"


def test_padded_causal_mask_skips_pad_keys_and_lets_a_pad_query_see_itself():
    from glm46.modules.attention import padded_causal_mask

    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    mask = padded_causal_mask(valid, past=2)  # [B, 1, 3, 5]: 3 queries after 2 cached keys
    causal = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    assert torch.equal(mask[1, 0], causal)
    assert torch.equal(mask[0, 0], causal & valid[0])
    pad_query = padded_causal_mask(valid[:, :2], past=0)[0, 0]  # [2, 2]: the first row's two pads
    assert torch.equal(pad_query, torch.eye(2, dtype=torch.bool)), "no query row may be all masked (NaN in SDPA)"


def test_padded_sampling_equals_unpadded_sampling(model):
    x = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(8))
    padded = torch.cat([torch.full((3, 4), 1), x], dim=1)
    mask = torch.cat([torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 6, dtype=torch.long)], dim=1)

    def sample(ids, attention_mask=None):
        generator = torch.Generator().manual_seed(7)
        return model.generate(ids, 10, 1.3, 20, 0.9, generator=generator, attention_mask=attention_mask)

    expected = sample(x)
    assert torch.equal(sample(x, torch.ones_like(x)), expected)
    assert torch.equal(sample(padded, mask)[:, 10:], expected[:, 6:])
    assert not torch.equal(sample(padded)[:, 10:], expected[:, 6:]), "without the mask pads should change the output"


def test_a_row_with_its_own_generator_samples_the_same_in_any_batch(model):
    """Per-row generators (GRPO seeds each completion by its prompt): a row's tokens do not depend on its batch."""
    x = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(9))

    def generators(*seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    together = model.generate(x, 10, 1.3, generator=generators(11, 12, 13))
    for i, seed in enumerate((11, 12, 13)):
        alone = model.generate(x[i : i + 1], 10, 1.3, generator=generators(seed))
        assert torch.equal(together[i : i + 1], alone), i
    swapped = model.generate(x[[2, 0]], 10, 1.3, generator=generators(13, 11))
    assert torch.equal(swapped, together[[2, 0]])
    assert not torch.equal(together, model.generate(x, 10, 1.3, generator=generators(21, 22, 23)))


def test_rows_of_one_prompt_are_prefilled_once_and_continue_as_each_alone(model, monkeypatch):
    """GRPO's samples of a prompt: the batch's distinct (padded) prompts go through the prefill once, and every row
    then samples, with its own generator, what it samples alone."""
    x = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    short = torch.cat([torch.full((1, 2), 1), x[1:, :4]], dim=1)  # a shorter prompt, left-padded
    rows = torch.cat([x[:1], short, x[:1], x[1:], short, x[:1]])  # 3 distinct prompts in 6 rows
    mask = torch.ones_like(rows)
    mask[[1, 4], :2] = 0
    prefilled = []
    forward = type(model.model).forward
    monkeypatch.setattr(
        type(model.model),
        "forward",
        lambda self, ids, *a, **k: prefilled.append(ids.shape) or forward(self, ids, *a, **k),
    )
    together = model.generate(
        rows, 8, 1.3, generator=[torch.Generator().manual_seed(s) for s in range(6)], attention_mask=mask
    )
    assert prefilled[0] == (3, 6) and prefilled[1] == (6, 1)
    for i in range(6):
        prompt = rows[i : i + 1, 2:] if i in (1, 4) else rows[i : i + 1]
        alone = model.generate(prompt, 8, 1.3, generator=[torch.Generator().manual_seed(i)])
        assert torch.equal(together[i, -8:], alone[0, -8:]), i
    assert not torch.equal(together[0], together[2])  # one prompt, two generators: two samples


def test_rows_that_ended_leave_the_batch_and_every_row_writes_what_it_writes_alone(model, monkeypatch):
    """Once the rows that ended are half the batch they leave it (its forwards shrink); each row, sampled with its
    own generator, still writes what it writes alone, an ended one its EOS to the end."""
    x = torch.randint(0, 96, (6, 5), generator=torch.Generator().manual_seed(5))

    def generators(rows):
        return [torch.Generator().manual_seed(100 + i) for i in rows]

    free = model.generate(x, 12, 1.3, generator=generators(range(6)))[:, 5:]
    eos = sorted({int(free[i, 1]) for i in range(4)} - {int(t) for t in free[4:, :3].flatten()})
    assert len(eos) >= 2, "rows 0-3 (some of them) end at their second token, rows 4 and 5 later"
    batches = []
    forward = type(model.model).forward
    monkeypatch.setattr(
        type(model.model), "forward", lambda self, ids, *a, **k: batches.append(len(ids)) or forward(self, ids, *a, **k)
    )
    together = model.generate(x, 12, 1.3, eos_token_id=eos, generator=generators(range(6)))
    assert batches[0] == 6 and min(batches) < 6
    for i in range(6):
        alone = model.generate(x[i : i + 1], 12, 1.3, eos_token_id=eos, generator=generators([i]))[0]
        ended = next((k for k, t in enumerate(alone[5:].tolist()) if t in eos), None)
        assert torch.equal(together[i, : len(alone)], alone), i
        if ended is not None:  # padded with its EOS to the batch's end
            assert (together[i, 5 + ended :] == alone[5 + ended]).all(), i


def test_generation_runs_until_every_rank_has_finished(model):
    """all_finished says whether every rank's rows have ended: until then this batch keeps stepping (padding with
    its EOS), as ranks whose forwards are collective must."""
    x = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(3))
    first = int(model.generate(x, 1)[0, -1])  # greedy's first token, made the EOS: it ends after one step
    assert model.generate(x, 8, eos_token_id=first).shape[1] == 5
    steps = []
    held = model.generate(x, 8, eos_token_id=first, all_finished=lambda done: steps.append(done) or len(steps) == 6)
    assert held.shape[1] == 4 + 6 and (held[0, 4:] == first).all() and all(steps)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        ([[1, 1, 0], [1, 1, 1]], "left padding"),
        ([[0, 1, 0], [1, 1, 1]], "left padding"),
        ([[0, 0, 0], [0, 1, 1]], "padding only"),
        ([[1, 1], [1, 1]], r"attention_mask \(2, 2\) != input_ids \(2, 3\)"),
    ],
)
def test_bad_attention_masks_are_refused(model, mask, match):
    with pytest.raises(ValueError, match=match):
        model.generate(torch.ones(2, 3, dtype=torch.long), 2, attention_mask=torch.tensor(mask))


def test_sampling_draws_each_token_with_its_probability():
    """The sampler against the distribution it samples: 40,000 draws from one row of 6 tokens (one of them impossible)
    within 4 standard errors of each probability, with one generator and with one per row; top-k and top-p never
    draw a token they cut, the last token included."""
    from glm46.modules.generation import sample_next_token

    probs = torch.tensor([0.5, 0.25, 0.125, 0.1, 0.025, 0.0])
    logits = probs.log().expand(40_000, -1)
    for generator in (torch.Generator().manual_seed(0), [torch.Generator().manual_seed(s) for s in range(40_000)]):
        counts = torch.bincount(sample_next_token(logits, 1.0, generator=generator), minlength=6).double()
        error = (probs.double() * (1 - probs.double()) / 40_000).sqrt()
        assert ((counts / 40_000 - probs).abs() <= 4 * error).all(), counts
        assert counts[-1] == 0
    last_cut = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(5_000, -1)  # the last token is the least likely
    top_k = sample_next_token(last_cut, 1.0, top_k=2, generator=torch.Generator().manual_seed(1))
    assert set(top_k.tolist()) == {1, 2}
    top_p = sample_next_token(last_cut, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(2))
    assert set(top_p.tolist()) == {2}
