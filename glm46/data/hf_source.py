"""source=hf: datasets as the `datasets` library keeps them on disk, read offline (nothing is downloaded):

- a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (read by `datasets.load_from_disk`; of
  a DatasetDict, the split `source.split`), its rows counted at `DIR:row N` (`DIR[split]:row N`);
- a folder in the Hub's layout (`data/train-00000-of-00001.parquet`, `train.jsonl`, ...): the data files of
  `source.split`, found by their names as the Hub finds them (datasets' `get_data_patterns`: a folder whose names
  give no split is all `train`), each read as source=parquet or source=jsonl reads it (`file:row N`, `file:line`).

A row is a record as source=jsonl's: its text in the column `source.text_key`, its id in `source.id_key`, optional
`url` and `domain`. A folder written by save_to_disk is one input (one read task); a Hub folder's files are split
over a staged preparation's tasks as source=parquet's are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from .documents import Document, Ledger
from .sources import (
    SUFFIXES,
    check_parquet,
    expanded_paths,
    files_of,
    formats,
    lacks_text_column,
    parquet_documents,
    read_jsonl,
    record_columns,
    record_document,
)

DATASET_DICT, DATASET = "dataset_dict.json", "state.json"  # what save_to_disk writes into its folder
BATCH = 1024  # rows converted at a time


def read_hf(
    paths: list[str],
    ledger: Ledger,
    default_domain: str = "general",
    text_key: str = "text",
    id_key: str = "id",
    split: str = "train",
) -> Iterator[Document]:
    """One document per row of each input of hf_inputs; every split and parquet footer checked before the first."""
    inputs = hf_inputs(paths, split)
    check_parquet([path for path in inputs if path.suffix == ".parquet"])
    for path in inputs:
        if _saved(path):
            yield from _saved_documents(path, split, ledger, default_domain, text_key, id_key)
        elif path.suffix == ".parquet":
            yield from parquet_documents(path, ledger, default_domain, text_key, id_key)
        else:
            yield from read_jsonl([str(path)], ledger, default_domain, text_key, id_key)


def hf_inputs(paths: list[str], split: str) -> list[Path]:
    """What source=hf reads, in order: each folder written by save_to_disk (holding `split`, if a DatasetDict's),
    the data files of `split` of each folder in the Hub's layout, each data file given as such; anything else is
    an error naming the path."""
    inputs = []
    for path in expanded_paths(paths):
        if _saved(path):
            _check_split(path, split)
            inputs.append(path)
        elif path.is_dir():
            inputs += _split_files(path, split)
        else:
            inputs += files_of([str(path)], SUFFIXES["hf"])
    return inputs


def _saved(path: Path) -> bool:
    """Whether `path` is a folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / DATASET_DICT).is_file() or (path / DATASET).is_file()


def _check_split(folder: Path, split: str) -> None:
    """A DatasetDict's folder must hold `split` (a Dataset's has no splits: it is read whole)."""
    if not (folder / DATASET_DICT).is_file():
        return
    splits = json.loads((folder / DATASET_DICT).read_text())["splits"]
    if split not in splits:
        raise ValueError(f"source.split={split}: {folder} holds the splits {', '.join(splits)}, not {split!r}")


def _split_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` in a folder in the Hub's layout, by their names as the Hub reads them."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        patterns = get_data_patterns(str(folder))
    except EmptyDatasetError:
        patterns = {}
    found = DataFilesDict.from_patterns(patterns, base_path=str(folder))  # absolute paths: named as given here
    splits = {
        str(name): sorted(folder / os.path.relpath(f, folder) for f in files if f.endswith(SUFFIXES["hf"]))
        for name, files in found.items()
    }
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        raise ValueError(
            f"source.paths: {folder} is neither a folder written by save_to_disk (it holds no {DATASET_DICT} nor "
            f"{DATASET}) nor a folder in the Hub's layout, whose data files are {formats(SUFFIXES['hf'])} named "
            f"by their split: data/train-00000-of-00001.parquet, train.jsonl, ..."
        )
    if split not in splits:
        raise ValueError(f"source.split={split}: {folder} holds files of the splits {', '.join(splits)}, not {split!r}")
    return splits[split]


def _saved_documents(
    folder: Path, split: str, ledger: Ledger, default_domain: str, text_key: str, id_key: str
) -> Iterator[Document]:
    """The rows of a folder written by save_to_disk (of a DatasetDict: its `split`), one document each."""
    from datasets import DatasetDict, load_from_disk

    dataset, where = load_from_disk(str(folder)), str(folder)
    if isinstance(dataset, DatasetDict):
        dataset, where = dataset[split], f"{folder}[{split}]"
    before, names = ledger.documents_in, dataset.column_names
    if not lacks_text_column(where, names, len(dataset), text_key, ledger):
        table = dataset.select_columns(record_columns(names, text_key, id_key)).with_format("arrow")
        records = (record for batch in table.iter(batch_size=BATCH) for record in batch.to_pylist())
        for row, record in enumerate(records):
            doc = record_document(record, f"{where}:row {row}", ledger, default_domain, 0, text_key, id_key)
            if doc is not None:
                yield doc
    ledger.read_file(where, before)
