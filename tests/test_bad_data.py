"""A catalogue of bad input to the data pipeline: each case is either counted in manifest.json (reason,
exact count, file:line, documents and bytes conserved) or an error naming the file or key, before any
work is wasted; never a crash in the middle of a run, never a silent loss.

Already asserted in tests/test_prepare.py, not repeated here: a line that is not JSON, a JSON array line,
a record without `text`, whitespace-only text, invalid UTF-8 in a JSONL line
(test_planted_folder_gives_the_expected_counts), invalid UTF-8 in a text file and a null parquet `text`
(test_text_folders_and_parquet_are_read_with_problems_counted), a missing JSONL path
(test_missing_input_path_is_named). tests/test_shard_data.py: a mixture domain the dataset lacks
(test_unknown_domain_and_missing_dataset_are_named), a made-up fingerprint (test_resume_on_other_data_fails_clearly).
"""

import json
import random
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import open_dict

from glm46.app.tasks import prepare_data, run_task
from glm46.config.checks import model_config
from glm46.config.schema import register_configs
from glm46.data.documents import Ledger
from glm46.data.pipeline import prepare_dataset
from glm46.data.prepare import EmptyDatasetError
from glm46.data.quality import QualityRules
from glm46.data.shards import write_shards
from glm46.data.sources import read_jsonl, read_parquet, read_text_folder
from glm46.data.tokenizer import GLMTokenizer, train_tokenizer
from glm46.errors import ConfigError
from glm46.lit.sft_data import SFTDataModule
from glm46.lit.shard_data import DataMismatchError, ShardDataModule

from .conftest import CONF_DIR
from .helpers import tiny_config
from .test_balancer import lit_module
from .test_prepare import DEDUP, VOCAB, prose

READERS = {"jsonl": read_jsonl, "text": read_text_folder, "parquet": read_parquet}


def good_lines(count: int = 2, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [json.dumps({"text": prose(rng)}) for _ in range(count)]


def run(reader: str, paths, output_dir, **quality) -> dict:
    return prepare_dataset(
        reader, [str(p) for p in paths], output_dir, dedup=DEDUP, quality=QualityRules(**quality), vocab_size=VOCAB
    )


def assert_conserved(manifest: dict) -> None:
    assert manifest["documents_in"] == manifest["documents_out"] + sum(manifest["dropped"].values())
    assert manifest["bytes_in"] == (
        manifest["bytes_out"] + sum(manifest["bytes_dropped"].values()) + manifest["bytes_trimmed"]
    )
    assert sum(d["documents"] for d in manifest["domains"].values()) == manifest["documents_out"]


# -- JSONL lines: every bad line is one input counted under its reason, at its file:line, with the problem
BAD_LINES = [
    ('{"text": "cut off in the mid', "malformed", "Unterminated string"),  # a truncated write
    ("42", "malformed", "a number, not an object with a string field 'text'"),
    ('"just a string"', "malformed", "a string, not an object"),
    ("null", "malformed", "null, not an object"),
    ('{"text": 7}', "malformed", "field 'text' is a number, not a string"),
    ('{"text": null}', "malformed", "field 'text' is null, not a string"),
    ('{"text": ["a", "b"]}', "malformed", "field 'text' is an array, not a string"),
    ('{"content": "x", "id": 3}', "malformed", "no field 'text' (fields: content, id)"),
    ('{"text": "x", "domain": "../../etc"}', "malformed", "field 'domain' is '../../etc', not a name"),
    ('{"text": "x", "domain": "web/en"}', "malformed", "field 'domain' is 'web/en'"),
    ('{"text": "x", "domain": {"name": "web"}}', "malformed", "field 'domain' is {'name': 'web'}"),
    ('{"text": "lone \\ud800 surrogate"}', "undecodable", "field 'text': surrogates not allowed"),
    ('{"text": ""}', "empty", None),
]


@pytest.mark.parametrize("line, reason, detail", BAD_LINES, ids=[f"{r}:{line[:24]}" for line, r, _ in BAD_LINES])
def test_a_bad_jsonl_line_is_counted_at_its_file_and_line(tmp_path, line, reason, detail):
    file = tmp_path / "in.jsonl"
    good = good_lines()
    file.write_text("\n".join([good[0], line, good[1]]) + "\n")
    manifest = run("jsonl", [file], tmp_path / "out")
    assert (manifest["documents_in"], manifest["documents_out"], manifest["dropped"]) == (3, 2, {reason: 1})
    assert_conserved(manifest)
    example = manifest["examples"][reason][0]
    assert example.startswith(f"{file}:2")
    if detail:
        assert detail in example
    if reason != "empty":  # a line that never became a document drops its raw bytes
        assert manifest["bytes_dropped"] == {reason: len(line) + 1}


def test_a_byte_order_mark_does_not_cost_the_first_line(tmp_path):
    file = tmp_path / "windows.jsonl"
    file.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(good_lines(2)).encode() + b"\r\n")
    manifest = run("jsonl", [file], tmp_path / "out")
    assert (manifest["documents_in"], manifest["documents_out"], manifest["dropped"]) == (2, 2, {})


# -- text folders: one document per file
def test_a_text_folder_counts_empty_blank_and_undecodable_files(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    rng = random.Random(1)
    (folder / "a.txt").write_text(prose(rng))
    (folder / "b.md").write_bytes(b"\xef\xbb\xbf" + prose(rng).encode())  # BOM: kept, without the BOM
    (folder / "empty.txt").write_text("")
    (folder / "blank.md").write_text(" \n\t\r\n ")
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    (folder / "notes.csv").write_text("not, read")  # not a .txt/.md file: not input
    manifest = run("text", [folder], tmp_path / "out")
    assert (manifest["documents_in"], manifest["documents_out"], manifest["files"]) == (5, 2, 5)
    assert manifest["dropped"] == {"empty": 2, "undecodable": 1}
    assert_conserved(manifest)
    assert sorted(manifest["examples"]["empty"]) == [str(folder / "blank.md"), str(folder / "empty.txt")]
    assert manifest["examples"]["undecodable"][0].startswith(f"{folder / 'latin1.txt'}: 'utf-8' codec")
    kept = (tmp_path / "out" / "documents" / "general.jsonl").read_text()
    assert "\ufeff" not in kept


# -- a gigantic document: dropped by max_chars before deduplication, so it never costs MinHash memory
def test_a_gigantic_document_is_dropped_by_max_chars_before_dedup(tmp_path):
    file = tmp_path / "in.jsonl"
    giant = prose(random.Random(2), words=20_000)  # ~110k characters against max_chars=10k
    file.write_text("\n".join(good_lines(2) + [json.dumps({"text": giant})] * 2) + "\n")
    manifest = run("jsonl", [file], tmp_path / "out", max_chars=10_000)
    assert manifest["dropped"] == {"quality/max_chars": 2}  # both copies: for length, not as duplicates
    assert manifest["bytes_dropped"] == {"quality/max_chars": 2 * len(giant)}
    assert manifest["examples"]["quality/max_chars"] == [f"{file}:3", f"{file}:4"]
    stages = {s["stage"]: s for s in manifest["stages"]}
    assert stages["max_chars"]["dropped"] == {"quality/max_chars": 2}
    assert stages["near_dedup"]["documents_in"] == 2 and stages["near_dedup"]["bytes_in"] < 10_000
    assert_conserved(manifest)


# -- parquet
def test_parquet_without_a_text_column_counts_every_row(tmp_path):
    pq.write_table(pa.table({"body": ["a", "b", "c"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [prose(random.Random(3))]}), tmp_path / "b.parquet")
    manifest = run("parquet", [tmp_path], tmp_path / "out")
    assert (manifest["documents_in"], manifest["documents_out"], manifest["dropped"]) == (4, 1, {"malformed": 3})
    example = f"{tmp_path / 'a.parquet'}:rows 0-2: no column 'text' (columns: body, id)"
    assert manifest["examples"]["malformed"] == [example]
    assert_conserved(manifest)


def test_parquet_text_of_the_wrong_type_counts_each_row(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": [prose(random.Random(4))]}), tmp_path / "ok.parquet")
    manifest = run("parquet", [tmp_path], tmp_path / "out")
    assert manifest["dropped"] == {"malformed": 2}
    assert (
        manifest["examples"]["malformed"][1] == f"{tmp_path / 'ints.parquet'}:row 1: field 'text' is a number, "
        f"not a string"
    )


def test_a_corrupt_parquet_row_group_counts_its_rows_and_keeps_the_others(tmp_path):
    rng = random.Random(5)
    file = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": [prose(rng) for _ in range(6)]}), file, row_group_size=3, compression="NONE")
    column = pq.ParquetFile(file).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(file.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    file.write_bytes(bytes(data))
    manifest = run("parquet", [file], tmp_path / "out")
    assert (manifest["documents_in"], manifest["documents_out"], manifest["dropped"]) == (6, 3, {"undecodable": 3})
    assert manifest["examples"]["undecodable"][0].startswith(f"{file}:rows 3-5: row group 1 does not read")
    assert_conserved(manifest)


def test_a_parquet_file_that_does_not_open_fails_before_any_document(tmp_path):
    pq.write_table(pa.table({"text": [prose(random.Random(6))]}), tmp_path / "a_good.parquet")
    (tmp_path / "b_bad.parquet").write_bytes(b"PAR1 not really parquet")
    ledger = Ledger()
    with pytest.raises(ValueError, match=r"b_bad\.parquet is not a readable parquet file \(.*magic bytes"):
        next(read_parquet([str(tmp_path)], ledger))
    assert ledger.documents_in == 0


# -- inputs that give nothing to count: errors naming the path, or the counts
@pytest.mark.parametrize("reader", ["text", "parquet"])  # jsonl: test_prepare.py::test_missing_input_path_is_named
def test_a_missing_input_path_is_named(tmp_path, reader):
    with pytest.raises(FileNotFoundError, match=f"source.paths: {tmp_path / 'nowhere'} does not exist"):
        next(READERS[reader]([str(tmp_path / "nowhere")], Ledger()))


@pytest.mark.parametrize(
    "reader, present, wanted",
    [
        ("jsonl", "data.csv", ".jsonl or .json"),
        ("text", "data.jsonl", ".txt or .md"),
        ("parquet", "data.txt", ".parquet"),
    ],
)
def test_a_folder_without_input_files_is_named(tmp_path, reader, present, wanted):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / present).write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"source.paths: {tmp_path / 'in'} holds no {wanted} files"):
        next(READERS[reader]([str(tmp_path / "in")], Ledger()))


def test_empty_input_files_are_listed_and_alone_are_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "good.jsonl").write_text("\n".join(good_lines()) + "\n")
    manifest = run(
        "jsonl", [tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", tmp_path / "good.jsonl"], tmp_path / "out"
    )
    assert (manifest["documents_in"], manifest["documents_out"], manifest["files"]) == (2, 2, 3)
    assert manifest["empty_files"] == [str(tmp_path / "empty.jsonl"), str(tmp_path / "blank.jsonl")]
    with pytest.raises(EmptyDatasetError, match=f"no documents in the input: 1 file.* {tmp_path / 'empty.jsonl'}"):
        run("jsonl", [tmp_path / "empty.jsonl"], tmp_path / "out2")


def test_a_dataset_empty_after_filtering_names_the_reasons_through_task_prepare(tmp_path):
    file = tmp_path / "in.jsonl"
    file.write_text('{"text": "too short"}\n{"text": "too short"}\n{"broken\n{"text": "   "}\n')
    cfg = composed(
        "task=prepare",
        "source=jsonl",
        f"source.paths=[{file}]",
        f"source.output_dir={tmp_path / 'out'}",
        "prepare.tokenizer.vocab_size=300",
        "prepare.num_workers=1",
    )
    with pytest.raises(EmptyDatasetError) as error:
        prepare_data(cfg, model_config(cfg))  # not a failure later, in tokenizer training or shard writing
    message = str(error.value)
    assert "4 in, 0 out; dropped: empty 1, exact_duplicate 1, malformed 1, quality/min_chars 1" in message
    assert "read+normalise 4 -> 2, exact_dedup 2 -> 1, quality 1 -> 0" in message
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())  # written, to look into
    assert manifest["documents_out"] == 0 and manifest["examples"]["malformed"][0].startswith(f"{file}:3")
    assert_conserved(manifest)
    assert not (tmp_path / "out" / "tokens").exists()


def test_a_tokenizer_of_ones_own_without_a_document_end_token_is_refused_before_any_work(tmp_path):
    file = tmp_path / "in.jsonl"
    file.write_text("\n".join(good_lines(4)) + "\n")
    own = tmp_path / "tokenizer.json"
    GLMTokenizer(train_tokenizer([prose(random.Random(0))], vocab_size=300, special_tokens=[])).save(own)
    cfg = composed(
        "task=prepare",
        "source=jsonl",
        f"source.paths=[{file}]",
        f"source.output_dir={tmp_path / 'out'}",
        f"prepare.tokenizer.path={own}",
    )
    with pytest.raises(ConfigError, match=f"prepare.tokenizer.path={own}: the tokenizer has no '<\\|endoftext\\|>'"):
        prepare_data(cfg, model_config(cfg))
    assert not (tmp_path / "out").exists()


def test_an_earlier_run_in_the_same_output_dir_leaves_no_domain_behind(tmp_path):
    (tmp_path / "web.jsonl").write_text(json.dumps({"text": prose(random.Random(7)), "domain": "web"}) + "\n")
    (tmp_path / "general.jsonl").write_text("\n".join(good_lines()) + "\n")
    run("jsonl", [tmp_path / "web.jsonl"], tmp_path / "out")
    manifest = run("jsonl", [tmp_path / "general.jsonl"], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "documents").iterdir()) == ["general.jsonl"]
    assert manifest["domains"].keys() == {"general"}


# -- training on a prepared dataset: a real one, built and read through the configs
def composed(*overrides: str, hydra: bool = False):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """60 documents of prose in `general`, prepared by task=prepare with a 300-token vocabulary."""
    root = tmp_path_factory.mktemp("bad_data")
    (root / "in.jsonl").write_text("\n".join(good_lines(60, seed=8)) + "\n")
    cfg = composed(
        "task=prepare",
        "source=jsonl",
        f"source.paths=[{root / 'in.jsonl'}]",
        f"source.output_dir={root / 'dataset'}",
        "prepare.tokenizer.vocab_size=300",
        "prepare.num_workers=1",
    )
    assert prepare_data(cfg, model_config(cfg))["documents_out"] == 60
    return root / "dataset"


def shards_config(path: Path, *overrides: str, mixture: str = "{general: 1.0}", hydra: bool = False):
    return composed(
        "experiment=tiny_bytes",
        "data=shards",
        f"data.path={path}",
        f"data.mixture={mixture}",
        "data.seq_len=32",
        "data.batch_size=2",
        *overrides,
        hydra=hydra,
    )


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(dataset, tmp_path):
    cfg = shards_config(dataset, "model.vocab_size=256", "trainer.max_steps=1", hydra=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)  # what Hydra sets when it runs the job
    HydraConfig.instance().set_config(cfg)
    try:
        with pytest.raises(
            ConfigError, match=r"its tokenizer \(.*tokenizer.json\) has 300 tokens, more than model.vocab_size=256"
        ):
            run_task(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert not (tmp_path / "checkpoints").exists()


def test_a_mixture_domain_the_dataset_lacks_names_both(dataset):
    cfg = shards_config(dataset, mixture="{general: 0.5, web: 0.5}")
    with pytest.raises(InstantiationException, match=r"\['web'\] that .* does not have \(it has \['general'\]\)"):
        instantiate(cfg.data)  # what train builds; validate() names them earlier, as a ConfigError
    off = instantiate(shards_config(dataset, mixture="{general: 1.0, web: 0.0}").data)  # 0: a domain turned off
    assert off.mixture == {"general": 1.0}


def truncate(file: Path, by: int) -> None:
    file.write_bytes(file.read_bytes()[:-by])


DAMAGE = {  # what is done to a copy of the dataset -> the error (the file it names)
    "bin truncated": (
        lambda d: truncate(d / "tokens" / "general.bin", 2),
        r"general\.bin holds \d+ bytes but shards\.json records \d+ uint16 tokens \(\d+ bytes\): the",
    ),
    "bin 1 byte short": (lambda d: truncate(d / "tokens" / "general.bin", 1), r"general\.bin holds \d+ bytes"),
    "bin missing": (lambda d: (d / "tokens" / "general.bin").unlink(), r"general\.bin is missing"),
    "offsets cut": (lambda d: truncate(d / "tokens" / "general.idx.npy", 40), r"general\.idx\.npy does not load"),
    "offsets of other data": (
        lambda d: shutil.copy(d / "other.npy", d / "tokens" / "general.idx.npy"),
        r"general\.idx\.npy does not hold the 61 document offsets",
    ),
    "shards.json cut": (lambda d: truncate(d / "tokens" / "shards.json", 20), r"shards\.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_shard_is_named_when_the_datamodule_sets_up(dataset, tmp_path, damage):
    copy = shutil.copytree(dataset, tmp_path / "copy")
    np.save(copy / "other.npy", np.arange(10))
    do, message = DAMAGE[damage]
    do(copy)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ShardDataModule(str(copy), seq_len=32, batch_size=2, mixture={"general": 1.0}).setup()


def test_a_missing_or_broken_tokenizer_is_named(dataset, tmp_path):
    copy = shutil.copytree(dataset, tmp_path / "copy")
    settings = {"seq_len": 32, "batch_size": 2, "mixture": {"general": 1.0}}
    (copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"tokenizer {copy / 'tokenizer.json'} does not exist"):
        SFTDataModule(str(copy), **settings)
    (copy / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    with pytest.raises(ValueError, match=f"tokenizer {copy / 'tokenizer.json'} does not load"):
        SFTDataModule(str(copy), **settings)


def test_resuming_a_checkpoint_on_another_dataset_is_refused(dataset, tmp_path):
    other = shutil.copytree(dataset, tmp_path / "other")  # the same tokenizer, one document fewer
    documents = other / "documents" / "general.jsonl"
    documents.write_text("".join(documents.read_text().splitlines(keepends=True)[1:]))
    write_shards(other, GLMTokenizer.from_file(other / "tokenizer.json"), num_threads=1)

    def fit(path: Path, ckpt_path=None):
        trainer = L.Trainer(
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
            enable_checkpointing=ckpt_path is None,
        )
        dm = ShardDataModule(str(path), seq_len=32, batch_size=2, mixture={"general": 1.0})
        trainer.fit(lit_module(tiny_config(vocab_size=300)), datamodule=dm, ckpt_path=ckpt_path)
        return trainer

    fit(dataset).save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(DataMismatchError, match=f"fingerprint .* but {other / 'tokens'} has"):
        fit(other, ckpt_path=tmp_path / "a.ckpt")
