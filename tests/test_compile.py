"""`module.compile`: each decoder layer compiled in place trains as the eager model does, keeps the state-dict keys,
and compiles once (no step after the first recompiles). On the CPU the layers compile with the `aot_eager` backend
(Dynamo's graphs and AOTAutograd's forward and backward, without inductor's code generation, which takes about a
minute on 2 cores); bench/gpu_suite.py compiles with inductor on a GPU."""

import copy

import lightning as L
import torch
from torch.utils.data import DataLoader

from glm46.lit import GLM46LitModule, TokenWindows
from glm46.modules.model import total_loss
from glm46.optim import Muon, Piecewise, WarmupCosine
from glm46.parallel.checkpointing import apply_activation_checkpointing
from glm46.parallel.compile import compile_decoder_layers, compiled_graphs

from .helpers import random_model, relative_error, tiny_config


class RecordGraphs(L.Callback):
    """Dynamo's compiled-frame count after each step."""

    def __init__(self):
        self.graphs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.graphs.append(compiled_graphs())


def train(compile: bool, steps: int = 4) -> tuple[GLM46LitModule, list[int]]:
    torch.manual_seed(0)
    module = GLM46LitModule(
        tiny_config(),
        optimizer=lambda groups: Muon(groups, lr=1e-3, ns_dtype=torch.float32),
        lr_schedule=WarmupCosine(warmup_tokens=0, total_tokens=1, min_factor=1.0),
        mtp_weight=Piecewise(values=[0.3], boundaries=[]),
        compile=compile,
        compile_backend="aot_eager",
    )
    tokens = torch.randint(0, module.config.vocab_size, (4_000,)).numpy()
    loader = DataLoader(TokenWindows(tokens, seq_len=32), batch_size=4)
    recorder = RecordGraphs()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    return module, recorder.graphs


def test_compiled_layers_train_as_eager_and_compile_once():
    eager, _ = train(compile=False)
    compiled, graphs = train(compile=True)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.layers.values())
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())  # in place: the same keys
    for name, weight in eager.model.state_dict().items():  # rounding only: an update moves a weight by ~1e-3
        torch.testing.assert_close(compiled.model.state_dict()[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * (len(graphs) - 1), f"recompiled: {graphs}"


def test_compiled_layers_under_activation_checkpointing():
    """The layout's recomputation wraps the layer's forward in hooks; the compiled layer runs inside them."""
    eager = random_model(tiny_config())
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(compiled)
    compile_decoder_layers(compiled, backend="aot_eager")
    x = torch.randint(0, eager.config.vocab_size, (2, 32))
    for model in (eager, compiled):
        total_loss(model(x, labels=x.roll(-1, dims=1)), 0.3, 1e-4).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert relative_error(b.grad, a.grad) < 1e-5, name


def test_packed_rows_of_other_documents_do_not_recompile():
    """Each batch packs its documents differently; the compiled layers must not specialise on the documents' lengths
    (a recompile per batch, then eager once Dynamo's cache is full): attention over packed documents runs between
    the compiled regions."""
    model = random_model(tiny_config())
    compile_decoder_layers(model, backend="aot_eager")

    def step(cuts: list[int]):
        rows = [torch.cat([torch.arange(n) for n in row]) for row in cuts]
        x = torch.randint(0, model.config.vocab_size, (len(rows), 32))
        total_loss(model(x, labels=x.roll(-1, dims=1), position_ids=torch.stack(rows)), 0.3, 1e-4).backward()

    step([[32], [32]])  # one document per row: plain causal attention
    step([[10, 22], [5, 27]])
    graphs = compiled_graphs()
    for cuts in ([[16, 16], [1, 31]], [[3, 7, 22], [20, 12]], [[30, 2], [8, 8, 16]]):
        step(cuts)
    assert compiled_graphs() == graphs
