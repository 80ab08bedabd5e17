"""KV-cache generation equals recomputing the whole sequence at every step."""

import pytest
import torch

from glm46.modules import KVCache

from .helpers import random_model, tiny_config


def generate_without_cache(model, x, steps, temperature=0.0, generator=None):
    from glm46.modules.sampling import sample_next_token

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
