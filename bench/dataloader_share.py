"""The data loader's share of a training step, and our loader against a plain torch DataLoader.

    python bench/dataloader_share.py                        # the prepared embedded corpus, the default run's model
    python bench/dataloader_share.py --preset small --device cuda --steps 20

For each data shape of the default run (pre-training: random-truncation windows, 8 x 256; mid-training:
best-fit packed documents, 8 x 1024; SFT: packed conversations with the assistant-only loss mask, 8 x 256):

- ours: the DataModule's train_dataloader (ShardDataModule, SFTDataModule), ms per batch as the trainer gets it;
- the peer: torch.utils.data.DataLoader over a numpy memmap of the same tokens, windows at random offsets
  (RandomSampler with replacement): the minimal pre-training loader, without mixture, packing or masks;
- the step: forward + backward + Muon step of the model on our loader's batches (bench/train_throughput.py's
  runner; without position ids, so a lower bound on the packed steps, which makes the share an upper bound),
  and how long each step waited for its batch (`wait`).

It prints our loader against the peer (each on its own, ms per batch) and the loader's share of a training
step, wait / (wait + step), which the project holds under 2%. With --workers 0 (the default, as the configs
run) the loader runs in the training process and its whole time is waited for; with workers (data.num_workers)
batches are built ahead in other processes, in the same order.
Needs a prepared dataset: python run.py task=prepare source=embedded (or the default run) writes the default path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import PRESETS, ours  # noqa: E402

from glm46.data.shards import load_shard  # noqa: E402
from glm46.lit.sft_data import SFTDataModule  # noqa: E402
from glm46.lit.shard_data import ShardDataModule  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    k: v for k, v in yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text()).items() if k != "defaults"
} | {"vocab_size": 8192}  # the default run's model (the embedded vocabulary)
MODELS = {"tiny": TINY, **{name: fields for name, (fields, _) in PRESETS.items()}}
CASES = [  # name, DataModule, mixture, packing, seq_len (the toy phases of conf/phase)
    (
        "pretrain (truncate)",
        ShardDataModule,
        {"code": 0.4, "docs": 0.15, "license": 0.15, "math": 0.2, "reasoning": 0.1},
        "truncate",
        256,
    ),
    ("midtrain (best_fit)", ShardDataModule, {"repo_code": 0.5, "reasoning": 0.3, "math": 0.2}, "best_fit", 1024),
    ("sft (best_fit, mask)", SFTDataModule, {"sft": 1.0}, "best_fit", 256),
]


class RandomWindows(Dataset):
    """The peer's dataset: seq_len + 1 tokens at an offset of the sampler's choosing."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) - self.seq_len - 1

    def __getitem__(self, offset: int) -> dict[str, torch.Tensor]:
        chunk = torch.from_numpy(self.tokens[offset : offset + self.seq_len + 1].astype(np.int64))
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


def peer_loader(path: Path, domain: str, seq_len: int, batch: int) -> DataLoader:
    tokens, _ = load_shard(path / "tokens", domain)
    dataset = RandomWindows(tokens, seq_len)
    sampler = RandomSampler(dataset, replacement=True, num_samples=1 << 30, generator=torch.Generator().manual_seed(0))
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def ms_per_batch(loader: DataLoader, batches: int, warmup: int = 3) -> float:
    iterator = iter(loader)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches * 1e3


def step_and_wait_ms(fields: dict, loader: DataLoader, device: torch.device, steps: int, dtype) -> tuple[float, float]:
    """(median training-step ms, median ms that the loop waited for the loader's next batch), training on the
    loader's batches: forward + backward + Muon step, as bench/train_throughput.py's runner times them."""
    runner = ours(fields, device, dtype, "muon", mtp=1)
    iterator, waits = iter(loader), []
    for number in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        batch = next(iterator)
        waits.append(time.perf_counter() - start)
        runner.step(batch["input_ids"].to(device, non_blocking=True))
        if number < 2:
            runner.step_times.clear()
    runner.release()
    return statistics.median(runner.step_times) * 1e3, statistics.median(waits[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=str(Path.home() / ".cache" / "glm46" / "embedded"))
    parser.add_argument("--preset", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="batches timed per loader on its own")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed per case")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes in the training loop")
    args = parser.parse_args()
    path, device = Path(args.path), torch.device(args.device)
    if not (path / "tokens" / "shards.json").is_file():
        sys.exit(f"{path} is not a prepared dataset: run `python run.py task=prepare source=embedded` first")
    dtype = torch.bfloat16 if device.type == "cuda" else None
    fields = MODELS[args.preset]
    print(
        f"model {args.preset} on {device} ({'bf16 autocast' if dtype else 'fp32'}), batch {args.batch}, "
        f"{torch.get_num_threads()} threads, {args.workers} loader workers in the loop; data {path}"
    )
    print(f"{'case':<22} {'ours ms':>8} {'peer ms':>8} {'ours/peer':>9} {'step ms':>9} {'wait ms':>8} {'share':>7}")
    for name, module, mixture, packing, seq_len in CASES:

        def datamodule(workers: int, module=module, seq_len=seq_len, mixture=mixture, packing=packing):
            dm = module(
                str(path),
                seq_len=seq_len,
                batch_size=args.batch,
                mixture=mixture,
                seed=0,
                packing=packing,
                num_workers=workers,
            )
            dm.setup()
            return dm

        ours_ms = ms_per_batch(datamodule(0).train_dataloader(), args.batches)
        peer = ms_per_batch(peer_loader(path, next(iter(mixture)), seq_len, args.batch), args.batches)
        step, wait = step_and_wait_ms(fields, datamodule(args.workers).train_dataloader(), device, args.steps, dtype)
        share = wait / (wait + step)
        print(
            f"{name:<22} {ours_ms:8.2f} {peer:8.2f} {ours_ms / peer:8.2f}x {step:9.1f} {wait:8.2f} {share:7.2%}"
            f"{'' if share <= 0.02 else '  > 2%'}"
        )


if __name__ == "__main__":
    main()
