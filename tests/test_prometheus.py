"""monitoring.prometheus_port: rank 0 of a training run serves its metrics; scraped while a real run trains, and
every metric the Grafana dashboard in the repository plots is among them."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from . import forked

ROOT = Path(__file__).resolve().parents[1]
QUICK = [  # micro-batches of 2 x 32 tokens
    "experiment=tiny_bytes",
    "data.max_bytes=200000",
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.limit_val_batches=0",
    "logger=csv",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float] | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_running_job_serves_its_metrics_for_prometheus(tmp_path):
    port = free_port()
    run = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *QUICK,
            "trainer.max_steps=10",
            "+callbacks.slow._target_=tests.helpers.SlowSteps",  # steps of at least 0.5 s: scraped several times
            "+callbacks.slow.seconds=0.5",
            f"paths.output_dir={tmp_path}",
            f"monitoring.prometheus_port={port}",
            "monitoring.prometheus_address=127.0.0.1",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    samples, deadline = [], time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline:
        metrics = scrape(port)
        if metrics and metrics.get("glm46_step", 0) > 0:
            samples.append(metrics)
        time.sleep(0.3)
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 0, output[-3000:]
    assert len(samples) >= 2, f"scraped {len(samples)} times during the run"
    first, last = samples[0], samples[-1]
    assert 0 < first["glm46_step"] <= last["glm46_step"] <= 10 and last["glm46_step"] > first["glm46_step"]
    assert math.isfinite(last["glm46_train_loss"]) and 0 < last["glm46_train_loss"] < 10
    assert last["glm46_perf_tokens_per_sec"] > 0 and last["glm46_moe_maxvio"] >= 0
    assert last["glm46_restarts"] == 0 and 0 <= last["glm46_checkpoint_age_seconds"] < 300
    assert scrape(port) is None, "the exporter stops with the run"

    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "glm46.json").read_text())
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"glm46_[a-z0-9_]+", target["expr"])
    }
    served = set().union(*samples)
    # val loss and the guard's count are logged by runs that validate or skip steps; this one does neither
    assert plotted - served <= {"glm46_val_loss", "glm46_guard_skipped_steps", "glm46_optim_grad_norm"}, (
        plotted - served
    )
    assert {"glm46_step", "glm46_train_loss", "glm46_perf_tokens_per_sec", "glm46_restarts"} <= plotted


def test_a_port_in_use_ends_the_run_naming_the_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = forked.run(
            [
                sys.executable,
                str(ROOT / "run.py"),
                *QUICK,
                "trainer.max_steps=2",
                f"paths.output_dir={tmp_path}",
                f"monitoring.prometheus_port={port}",
                "monitoring.prometheus_address=127.0.0.1",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode != 0
    assert f"monitoring.prometheus_port={port}: cannot serve the metrics on 127.0.0.1" in result.stderr + result.stdout
