"""The readers of the formats users have (datatrove's conventions): JSON records plain or compressed (.gz, .zst),
JSON arrays, other field names (source.text_key, source.id_key), and `datasets` folders, written by save_to_disk or
in the Hub's layout (source=hf). Every input is a document or counted where it is; what cannot be read at all is
refused before the first document, naming the path.

Already asserted elsewhere, not repeated here: each kind of bad JSONL line (tests/test_bad_data.py), a folder
without input files and a missing path (test_bad_data.py, test_prepare.py).
"""

import gzip
import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from datasets import Dataset, DatasetDict

from glm46.config.data_checks import check_prepare
from glm46.data.cache import prepare_fingerprint
from glm46.data.chat_formats import read_chat
from glm46.data.documents import Ledger
from glm46.data.hf_source import read_hf
from glm46.data.pipeline import prepare_dataset
from glm46.data.prepare import READERS
from glm46.data.quality import QualityRules
from glm46.data.sources import read_jsonl, read_parquet
from glm46.data.staged.work import make_plan
from glm46.errors import ConfigError

from .test_prepare import DEDUP, VOCAB, prose

COMPRESS = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}
CODECS = {".gz": "gzip", ".zst": "zstd"}
FORMATS = re.escape("it reads .jsonl or .json files, plain or compressed (.gz, .zst)")


def records(count: int, seed: int = 0, text: str = "text", key: str = "id") -> list[dict]:
    rng = random.Random(seed)
    return [{text: prose(rng), key: f"doc-{seed}-{i}", "domain": "web"} for i in range(count)]


def jsonl(rows: list) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def read(reader, paths, **keys) -> tuple[list, Ledger]:
    ledger = Ledger()
    return list(reader([str(p) for p in paths], ledger, **keys)), ledger


def fields(docs) -> list[tuple]:
    """What a document holds, but its source (file:line, file:item N, ...)."""
    return [(d.text, d.id, d.domain, d.url) for d in docs]


def conserved(docs, ledger: Ledger) -> bool:
    """Every input a document or counted, in documents and bytes."""
    return ledger.documents_in == len(docs) + sum(ledger.dropped.values()) and ledger.bytes_in == sum(
        d.nbytes for d in docs
    ) + sum(ledger.dropped_bytes.values())


# -- JSON records: compressed, arrays, JSON Lines named .json
@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_a_compressed_jsonl_file_reads_as_the_plain_one(tmp_path, suffix):
    rows = records(6)
    (tmp_path / "plain.jsonl").write_bytes(jsonl(rows))
    whole = tmp_path / f"whole.jsonl{suffix}"
    whole.write_bytes(COMPRESS[suffix](jsonl(rows)))
    members = tmp_path / f"members.jsonl{suffix}"  # concatenated gzip members, zstd frames: what `cat` makes
    members.write_bytes(COMPRESS[suffix](jsonl(rows[:2])) + COMPRESS[suffix](jsonl(rows[2:])))
    plain, _ = read(read_jsonl, [tmp_path / "plain.jsonl"])
    for file in (whole, members):
        docs, ledger = read(read_jsonl, [file])
        assert fields(docs) == fields(plain) and not ledger.dropped and ledger.files == 1
        assert [d.source for d in docs] == [f"{file}:{n}" for n in range(1, 7)]


def test_a_folder_is_searched_for_every_json_format(tmp_path):
    rows = records(6)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl(rows[:2])))
    (tmp_path / "b.json").write_text(json.dumps(rows[2:4]))
    (tmp_path / "c.jsonl.zst").write_bytes(COMPRESS[".zst"](jsonl(rows[4:])))
    (tmp_path / "notes.csv").write_text("not, read")  # in a folder: not input
    docs, ledger = read(read_jsonl, [tmp_path])
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in rows] and ledger.files == 3


def test_a_json_array_is_one_record_per_element(tmp_path):
    rows = records(3)
    file = tmp_path / "array.json.gz"
    file.write_bytes(gzip.compress(json.dumps([rows[0], 42, rows[1], {"body": "x"}, rows[2]], indent=2).encode()))
    docs, ledger = read(read_jsonl, [file])
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in rows]
    assert [d.source for d in docs] == [f"{file}:item {n}" for n in (0, 2, 4)]
    assert ledger.examples["malformed"] == [
        f"{file}:item 1: a number, not an object with a string field 'text'",
        f"{file}:item 3: no field 'text' (fields: body)",
    ]
    assert conserved(docs, ledger)


def test_a_json_file_of_lines_reads_as_jsonl(tmp_path):
    rows = records(4)
    (tmp_path / "lines.jsonl").write_bytes(jsonl(rows))
    (tmp_path / "lines.json").write_bytes(b"\xef\xbb\xbf" + jsonl(rows[:2]) + b"{broken\n" + jsonl(rows[2:]))
    (tmp_path / "one.json").write_text(json.dumps(rows[0]))  # a single line: one record
    docs, ledger = read(read_jsonl, [tmp_path / "lines.json"])
    assert fields(docs) == fields(read(read_jsonl, [tmp_path / "lines.jsonl"])[0])
    assert ledger.examples["malformed"][0].startswith(f"{tmp_path / 'lines.json'}:3: Expecting property name")
    assert fields(read(read_jsonl, [tmp_path / "one.json"])[0]) == fields(docs[:1])


@pytest.mark.parametrize(
    "content, detail",
    [
        (json.dumps(records(1)[0], indent=2), "an object over 5 lines: a .json file holds an array of records or one"),
        ('[{"text": "a"},\n {"text": ', "a JSON array that does not parse: Expecting value: line 2 column 11"),
    ],
    ids=["pretty-printed object", "cut-off array"],
)
def test_a_json_file_neither_array_nor_lines_is_one_malformed_input(tmp_path, content, detail):
    file = tmp_path / "data.json"
    file.write_text(content)
    docs, ledger = read(read_jsonl, [file])
    assert not docs and ledger.dropped == {"malformed": 1} and conserved(docs, ledger)
    assert ledger.examples["malformed"][0].startswith(f"{file}: {detail}")


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
@pytest.mark.parametrize("damage", ["cut off", "corrupt"])
def test_a_broken_compressed_stream_keeps_the_lines_before_it_and_counts_the_break(tmp_path, suffix, damage):
    rows, compress = records(20), COMPRESS[suffix]
    second = compress(jsonl(rows[10:]))
    second = second[: len(second) // 2] if damage == "cut off" else second[:4] + b"\x00\xff" * 40  # a good header
    file = tmp_path / f"broken.jsonl{suffix}"
    file.write_bytes(compress(jsonl(rows[:10])) + second)
    docs, ledger = read(read_jsonl, [file])
    assert 10 <= len(docs) < 20 and fields(docs) == [(r["text"], r["id"], "web", None) for r in rows[: len(docs)]]
    assert ledger.dropped == {"undecodable": 1} and conserved(docs, ledger)
    assert ledger.examples["undecodable"][0].startswith(
        f"{file}:{len(docs) + 1}: the {CODECS[suffix]} stream is {damage}"
    )
    assert ledger.examples["undecodable"][0].endswith(f"what follows line {len(docs)}")


def test_a_broken_compressed_json_array_is_one_undecodable_input(tmp_path):
    file = tmp_path / "array.json.gz"
    file.write_bytes(gzip.compress(json.dumps(records(5)).encode())[:-20])
    docs, ledger = read(read_jsonl, [file])
    assert not docs and ledger.dropped == {"undecodable": 1}
    assert ledger.examples["undecodable"] == [
        f"{file}: the gzip stream is cut off (the file ends inside it) (a .json file is read whole)"
    ]


def test_conversations_are_read_compressed_and_as_arrays_too(tmp_path):
    conversation = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    (tmp_path / "chat.jsonl").write_bytes(jsonl([conversation]))
    (tmp_path / "chat.jsonl.zst").write_bytes(COMPRESS[".zst"](jsonl([conversation])))
    (tmp_path / "chat.json").write_text(json.dumps([conversation]))
    texts = [[d.text for d in read(read_chat, [tmp_path / name])[0]] for name in ("chat.jsonl.zst", "chat.json")]
    assert texts == [[d.text for d in read(read_chat, [tmp_path / "chat.jsonl"])[0]]] * 2


@pytest.mark.parametrize("reader", ["jsonl", "chat", "preference"])
@pytest.mark.parametrize("name", ["data.csv", "x.txt", "data.jsonl.bz2"])
def test_a_file_of_a_format_not_read_is_refused_before_the_first_document(tmp_path, reader, name):
    (tmp_path / "good.jsonl").write_bytes(jsonl(records(1)))
    (tmp_path / name).write_bytes(jsonl(records(1)))
    ledger = Ledger()
    message = f"source.paths: {re.escape(str(tmp_path / name))} is of no format this source reads: {FORMATS}"
    with pytest.raises(ValueError, match=message):
        next(READERS[reader]([str(tmp_path / "good.jsonl"), str(tmp_path / name)], ledger))
    assert ledger.documents_in == 0


def test_a_path_of_another_format_is_refused_by_parquet_and_by_the_plan(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"data\.txt is of no format this source reads: it reads \.parquet files$"):
        next(read_parquet([str(tmp_path / "data.txt")], Ledger()))
    source, settings = nodes("jsonl", [tmp_path / "data.txt"], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"data\.txt is of no format this source reads: it reads \.jsonl or"):
        make_plan(source, settings, "f")
    assert not (tmp_path / "out").exists()


# -- other field names: source.text_key, source.id_key
def test_text_key_and_id_key_name_the_fields_and_the_details(tmp_path):
    rows = records(2, text="content", key="path")
    file = tmp_path / "stack.jsonl"
    file.write_bytes(jsonl([rows[0], {"text": "no content", "path": "x"}, {"content": 7}, rows[1]]))
    docs, ledger = read(read_jsonl, [file], text_key="content", id_key="path")
    assert fields(docs) == [(r["content"], r["path"], "web", None) for r in rows]
    assert ledger.examples["malformed"] == [
        f"{file}:2: no field 'content' (fields: text, path)",
        f"{file}:3: field 'content' is a number, not a string",
    ]
    pq.write_table(
        pa.Table.from_pylist(rows + [{"content": None, "path": "y", "domain": "web"}]), tmp_path / "a.parquet"
    )
    docs, ledger = read(read_parquet, [tmp_path / "a.parquet"], text_key="content", id_key="path")
    assert fields(docs) == [(r["content"], r["path"], "web", None) for r in rows]
    assert ledger.examples["malformed"] == [f"{tmp_path / 'a.parquet'}:row 2: field 'content' is null, not a string"]
    _, ledger = read(read_parquet, [tmp_path / "a.parquet"])  # the default key: every row counted at once
    assert ledger.examples["malformed"] == [
        f"{tmp_path / 'a.parquet'}:rows 0-2: no column 'text' (columns: content, path, domain)"
    ]


def nodes(reader: str, paths: list, output: Path, tasks: int = 1, **keys) -> tuple[dict, dict]:
    """A `source` node and `prepare` settings, as task=prepare gives them to the staged plan."""
    source = {"reader": reader, "paths": [str(p) for p in paths], "output_dir": str(output), "default_domain": "g"}
    settings = {
        "tasks": tasks,
        "dedup": DEDUP,
        "quality": vars(QualityRules()),
        "tokenizer": {"path": None, "vocab_size": VOCAB, "max_digits": 3},
    }
    return source | keys, settings


def test_the_keys_reach_the_staged_readers_and_the_fingerprint(tmp_path):
    (tmp_path / "stack.jsonl").write_bytes(jsonl(records(2, text="content", key="path")))
    source, settings = nodes("jsonl", [tmp_path / "stack.jsonl"], tmp_path / "out")
    plan = make_plan(source | {"text_key": "content", "id_key": "path"}, settings, "f")
    assert plan.options == {"text_key": "content", "id_key": "path"}
    docs = list(READERS[plan.reader](plan.shards[0], Ledger(), plan.default_domain, **plan.options))
    assert [d.id for d in docs] == ["doc-0-0", "doc-0-1"]
    default = prepare_fingerprint(source, settings)
    assert prepare_fingerprint(source | {"text_key": "text", "id_key": "id", "split": None}, settings) == default
    assert prepare_fingerprint(source | {"text_key": "content"}, settings) != default
    assert prepare_fingerprint(source | {"id_key": "path"}, settings) != default
    with pytest.raises(ConfigError, match=r"source.text_key=content: source=chat has no use for it \(it is read by "):
        make_plan(nodes("chat", [tmp_path / "stack.jsonl"], tmp_path / "out", text_key="content")[0], settings, "f")
    with pytest.raises(ConfigError, match=r"source.split=test: source=jsonl has no use for it .*source=hf\)"):
        make_plan(source | {"split": "test"}, settings, "f")


# -- source=hf: datasets folders
def test_a_folder_written_by_save_to_disk_is_read_by_rows(tmp_path):
    rows = records(3, text="content")
    Dataset.from_list(rows[:1] + [{"content": None, "id": "x", "domain": "web"}] + rows[1:]).save_to_disk(
        tmp_path / "ds"
    )
    docs, ledger = read(read_hf, [tmp_path / "ds"], text_key="content")
    assert fields(docs) == [(r["content"], r["id"], "web", None) for r in rows]
    assert [d.source for d in docs] == [f"{tmp_path / 'ds'}:row {n}" for n in (0, 2, 3)]
    assert ledger.examples["malformed"] == [f"{tmp_path / 'ds'}:row 1: field 'content' is null, not a string"]
    _, ledger = read(read_hf, [tmp_path / "ds"])
    assert ledger.examples["malformed"] == [
        f"{tmp_path / 'ds'}:rows 0-3: no column 'text' (columns: content, id, domain)"
    ]


def test_a_dataset_dict_folder_reads_the_split_chosen_and_refuses_a_missing_one(tmp_path):
    train, test = records(2, seed=1), records(3, seed=2)
    DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)}).save_to_disk(tmp_path / "dd")
    docs, _ = read(read_hf, [tmp_path / "dd"])
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in train]
    docs, _ = read(read_hf, [tmp_path / "dd"], split="test")
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in test]
    assert docs[2].source == f"{tmp_path / 'dd'}[test]:row 2"
    with pytest.raises(ValueError, match=r"source.split=validation: .*/dd holds the splits train, test, not 'valid"):
        read(read_hf, [tmp_path / "dd"], split="validation")


@pytest.fixture
def hub_folder(tmp_path) -> Path:
    """A dataset repository's layout: parquet files per split under data/, and its card."""
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    for name, seed in [("train-00000-of-00002", 1), ("train-00001-of-00002", 2), ("test-00000-of-00001", 3)]:
        pq.write_table(pa.Table.from_pylist(records(2, seed=seed)), folder / "data" / f"{name}.parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n")
    return folder


def test_a_hub_folder_reads_the_files_of_its_split(hub_folder, tmp_path):
    docs, ledger = read(read_hf, [hub_folder])
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in records(2, seed=1) + records(2, seed=2)]
    assert docs[3].source == f"{hub_folder / 'data' / 'train-00001-of-00002.parquet'}:row 1" and ledger.files == 2
    docs, _ = read(read_hf, [hub_folder], split="test")
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in records(2, seed=3)]
    with pytest.raises(ValueError, match=r"source.split=validation: .*/hub holds files of the splits train, test"):
        read(read_hf, [hub_folder], split="validation")
    jsonl_hub = tmp_path / "jsonl_hub"  # JSON files named by their split
    jsonl_hub.mkdir()
    (jsonl_hub / "train.jsonl.gz").write_bytes(gzip.compress(jsonl(records(1, seed=4))))
    (jsonl_hub / "validation.json").write_text(json.dumps(records(2, seed=5)))
    docs, _ = read(read_hf, [jsonl_hub], split="validation")
    assert [d.source for d in docs] == [f"{jsonl_hub / 'validation.json'}:item {n}" for n in (0, 1)]


def test_a_folder_that_is_no_dataset_is_refused_naming_it(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(
        ValueError,
        match=r"source.paths: .*/notes is neither a folder written by save_to_disk .* nor a "
        r"folder in the Hub's layout, whose data files are \.parquet or \.jsonl or \.json files",
    ):
        read(read_hf, [tmp_path / "notes"])


def test_over_tasks_a_hub_folder_splits_by_files_and_a_saved_folder_is_refused(hub_folder, tmp_path, compose_config):
    source, settings = nodes("hf", [hub_folder], tmp_path / "out", tasks=2, split="train")
    plan = make_plan(source, settings, "f")
    assert plan.shards == [[str(hub_folder / "data" / f"train-0000{i}-of-00002.parquet")] for i in (0, 1)]
    docs = list(READERS[plan.reader](plan.shards[1], Ledger(), plan.default_domain, **plan.options))
    assert fields(docs) == [(r["text"], r["id"], "web", None) for r in records(2, seed=2)]
    Dataset.from_list(records(4)).save_to_disk(tmp_path / "ds")
    cfg = compose_config(
        "task=prepare",
        "source=hf",
        f"source.paths=[{tmp_path / 'ds'}]",
        f"source.output_dir={tmp_path / 'out'}",
        "prepare.tasks=2",
    )
    assert (cfg.source.reader, cfg.source.split, cfg.source.text_key, cfg.source.id_key) == (
        "hf",
        "train",
        "text",
        "id",
    )
    with pytest.raises(
        ConfigError, match=r"prepare.tasks=2: source.paths holds 1 input file.*save_to_disk is one input"
    ):
        check_prepare(cfg)


# -- end to end: task=prepare's preparation and its manifest
def test_a_compressed_input_with_other_keys_is_prepared_and_every_input_accounted_for(tmp_path):
    rows = records(8, seed=6, text="content", key="path")
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part-0.jsonl.gz").write_bytes(gzip.compress(jsonl(rows[:2]) + b"{broken\n" + jsonl(rows[2:4])))
    (folder / "part-1.json.zst").write_bytes(COMPRESS[".zst"](json.dumps(rows[4:] + [{"content": 1}]).encode()))
    manifest = prepare_dataset(
        "jsonl", [str(folder)], tmp_path / "out", text_key="content", id_key="path", dedup=DEDUP, vocab_size=VOCAB
    )
    assert (manifest["documents_in"], manifest["documents_out"], manifest["files"]) == (10, 8, 2)
    assert manifest["documents_in"] == manifest["documents_out"] + sum(manifest["dropped"].values())
    assert manifest["dropped"] == {"malformed": 2}
    assert manifest["examples"]["malformed"] == [
        f"{folder / 'part-0.jsonl.gz'}:3: Expecting property name enclosed in double quotes (column 2)",
        f"{folder / 'part-1.json.zst'}:item 4: field 'content' is a number, not a string",
    ]
    kept = [json.loads(line) for line in (tmp_path / "out" / "documents" / "web.jsonl").read_text().splitlines()]
    assert [d["id"] for d in kept] == [r["path"] for r in rows]
