"""The BPE tokenizer: GLM special tokens, round trip on the corpus, tiktoken ids identical to tokenizers',
and token shards that equal per-document encoding."""

import hashlib
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from glm46.data.documents import Ledger
from glm46.data.embedded import generated, stdlib_code
from glm46.data.shards import EOS, encode_documents, load_shard, write_shards
from glm46.data.tokenizer import SPECIAL_TOKENS, GLMTokenizer, train_tokenizer


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    ledger = Ledger()
    code = [doc.text for _, doc in zip(range(60), stdlib_code(ledger))]
    return (
        code
        + [doc.text for doc in generated(ledger, math_problems=300, reasoning_problems=200, seed=0)]
        + [
            "unicode: héllo wörld, 数学, emoji 🙂\r\n\ttabs   and  spaces\n\n\n",
            "<|user|>hi<|assistant|><think>x</think>",
        ]
    )


@pytest.fixture(scope="module")
def tokenizer(corpus) -> GLMTokenizer:
    return GLMTokenizer(train_tokenizer(corpus, vocab_size=1024))


def test_vocabulary_size_and_glm_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 1024
    ids = [tokenizer.token_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(1024 - len(SPECIAL_TOKENS), 1024)), "special tokens are single ids, in GLM's order"
    assert tokenizer.encode("[gMASK]<sop><|user|>") == [tokenizer.token_id(t) for t in ("[gMASK]", "<sop>", "<|user|>")]


def test_round_trip_on_the_corpus(tokenizer, corpus):
    for text in corpus:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tiktoken_ids_equal_tokenizers_ids(tokenizer, corpus):
    expected = [e.ids for e in tokenizer.tokenizer.encode_batch(corpus)]
    for text, ids in zip(corpus, expected):
        assert tokenizer.encode(text) == ids
        array = tokenizer.encode_to_numpy(text)
        assert array.dtype == np.uint32 and array.tolist() == ids
    assert tokenizer.encode_batch(corpus) == expected


def test_saved_tokenizer_json_loads_identically(tokenizer, corpus, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = GLMTokenizer.from_file(tmp_path / "tokenizer.json")
    assert [loaded.encode(t) for t in corpus] == [tokenizer.encode(t) for t in corpus]
    with pytest.raises(KeyError, match="<nope>"):
        loaded.token_id("<nope>")


@pytest.mark.parametrize("max_digits", [1, 2])
def test_numbers_split_into_at_most_max_digits(corpus, max_digits, tmp_path):
    """The digit rule travels in tokenizer.json: tiktoken, built from the saved file, splits numbers as it was
    trained to (GLM's default: runs of up to 3)."""
    numbers = "What is 4821 * 37? 1234567 and 90."
    trained = GLMTokenizer(train_tokenizer(corpus + [numbers] * 50, vocab_size=600, max_digits=max_digits))
    trained.save(tmp_path / "tokenizer.json")
    loaded = GLMTokenizer.from_file(tmp_path / "tokenizer.json")
    pieces = [loaded.decode([i]) for i in loaded.encode(numbers)]
    digits = [p.strip() for p in pieces if p.strip().isdigit()]
    assert "".join(digits) == "4821371234567" + "90" and max(map(len, digits)) <= max_digits
    runs = [piece for piece, _ in loaded.tokenizer.pre_tokenizer.pre_tokenize_str("1234567")]
    assert runs == {1: list("1234567"), 2: ["12", "34", "56", "7"]}[max_digits]
    assert all(p.strip().isdigit() or not any(c.isdigit() for c in p) for p in pieces), "digits share no token"
    assert [loaded.encode(t) for t in corpus] == [e.ids for e in loaded.tokenizer.encode_batch(corpus)]


def test_glm_splits_numbers_into_runs_of_three(tokenizer):
    """GLM-4's pre-tokenizer cuts numbers into runs of up to 3 digits, which BPE merges no further."""
    assert [piece for piece, _ in tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str("1234567")] == ["123", "456", "7"]


def test_a_tokenizer_without_a_regex_split_is_refused(tokenizer):
    other = GLMTokenizer(Tokenizer.from_str(tokenizer.tokenizer.to_str()))
    other.tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ValueError, match=r"pre-tokenizer \(Whitespace\) has no regex Split"):
        other.encode("x")


def test_encode_documents_equals_one_by_one_with_eos(tokenizer, corpus):
    texts = corpus + [f"a text holding a literal {EOS} inside"]
    eos = tokenizer.token_id(EOS)
    expected = [tokenizer.tokenizer.encode(t).ids + [eos] for t in texts]
    for chunk_chars, num_threads in ((2000, 2), (2000, 1), (1 << 20, 2)):  # many chunks, or one
        tokens, offsets = encode_documents(texts, tokenizer, chunk_chars=chunk_chars, num_threads=num_threads)
        assert tokens.dtype == np.uint32 and tokens.tolist() == [i for ids in expected for i in ids]
        assert offsets.tolist() == np.cumsum([0] + [len(ids) for ids in expected]).tolist()
    tokens, offsets = encode_documents([], tokenizer)
    assert len(tokens) == 0 and offsets.tolist() == [0]


def test_shards_per_domain_with_fingerprint(tokenizer, tmp_path):
    documents = tmp_path / "documents"
    documents.mkdir()
    for domain, texts in {"code": ["def f(): pass", "x = 1"], "math": ["Question: 1 + 1?\nAnswer: 2"]}.items():
        (documents / f"{domain}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    index = write_shards(tmp_path, tokenizer)
    assert index["dtype"] == "uint16" and index["domains"]["code"]["documents"] == 2
    tokens, offsets = load_shard(tmp_path / "tokens", "code")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    second = tokens[offsets[1] : offsets[2]].tolist()
    assert second == tokenizer.encode("x = 1") + [tokenizer.token_id(EOS)]
    # the tokenizer, then per domain its name and the digest of each CHUNK_TOKENS piece (one here)
    fingerprint = hashlib.blake2b(tokenizer.tokenizer.to_str().encode(), digest_size=16)
    for domain in ("code", "math"):
        piece = hashlib.blake2b(load_shard(tmp_path / "tokens", domain)[0].tobytes(), digest_size=16).digest()
        fingerprint.update(domain.encode() + piece)
    assert index["fingerprint"] == fingerprint.hexdigest()

    (documents / "math.jsonl").write_text(json.dumps({"text": "Question: 1 + 2?\nAnswer: 3"}) + "\n")
    assert write_shards(tmp_path, tokenizer)["fingerprint"] != index["fingerprint"]


def test_chat_template_masks_assistant_turns_only(tokenizer):
    from glm46.data.chat import format_chat

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 * 3?"},
        {"role": "assistant", "content": "<think>3 * 3 = 9</think>9"},
    ]
    ids, mask = format_chat(messages, tokenizer)
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids) == (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nWhat is 2 + 2?<|assistant|>\n<think></think>\n4"
        "<|user|>\nAnd 3 * 3?<|assistant|>\n<think>3 * 3 = 9</think>\n9<|endoftext|>"
    )
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    # each reply from the newline after <|assistant|> (where a prompt ends) to the token that closes it
    assert trained == "\n<think></think>\n4<|user|>\n<think>3 * 3 = 9</think>\n9<|endoftext|>"
    with pytest.raises(ValueError, match="role 'observation'"):
        format_chat([{"role": "observation", "content": "x"}], tokenizer)
