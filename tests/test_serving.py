"""Serving: the HF export is what engines need (weights, config, stop ids, tokenizer and chat template beside them);
task=serve's engine commands and what it refuses; and (marker `serving`) vLLM's CPU build serving a trained export,
its greedy tokens equal to GLM46ForCausalLM.generate's without and with MTP speculative decoding."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors import safe_open
from transformers import AutoTokenizer

from glm46.app.tasks import run_task
from glm46.checkpoint.hub_config import config_to_hf
from glm46.checkpoint.hub_files import SINGLE_FILE
from glm46.config.checks import model_config
from glm46.data.chat import ROLE_TOKENS, STOP_TOKENS, format_chat, parse_tool_calls, render_chat
from glm46.data.tokenizer import GLMTokenizer
from glm46.errors import ConfigError
from glm46.hf import load_hf, save_hf
from glm46.modules import GLM46ForCausalLM
from glm46.serve.offline import serving_python, vllm_generate

from .helpers import random_model, require_venv, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOOL_PARSER_PLUGIN = ROOT / "glm46" / "serve" / "vllm_tool_parser.py"
# The keys of GLM-4.x's Hub config.json (zai-org/GLM-4.7 refs/pr/49, the GLM-4.5/4.6 architecture).
HUB_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "pad_token_id", "eos_token_id", "head_dim", "hidden_act",
    "hidden_size", "partial_rotary_factor", "initializer_range", "intermediate_size", "max_position_embeddings",
    "model_type", "moe_intermediate_size", "norm_topk_prob", "num_attention_heads", "n_group", "topk_group",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "num_experts_per_tok", "first_k_dense_replace",
    "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_scaling", "rope_theta",
    "num_nextn_predict_layers", "tie_word_embeddings", "torch_dtype", "use_cache", "use_qk_norm", "vocab_size",
}  # fmt: skip
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "What is 1234 * 56?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1234 * 56"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "69104"},
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a prime.\nOne only."}],
    [
        {"role": "user", "content": "def f(x):\n    return x * 2"},
        {"role": "assistant", "content": " It doubles x."},
        {"role": "tool", "content": "{'ok': true}"},
        {"role": "user", "content": "And f(21)?"},
    ],
]


@pytest.fixture(scope="module")
def dataset(chat_dataset):
    return chat_dataset


@pytest.fixture(scope="module")
def tokenizer(dataset):
    return GLMTokenizer.from_file(dataset / "tokenizer.json")


@pytest.fixture(scope="module")
def model(tokenizer):
    return random_model(tiny_config(vocab_size=tokenizer.vocab_size), seed=0)


@pytest.fixture(scope="module")
def export(model, tokenizer, tmp_path_factory):
    return save_hf(model, tmp_path_factory.mktemp("export") / "hf", tokenizer=tokenizer)


def stop_ids(tokenizer: GLMTokenizer) -> list[int]:
    return [tokenizer.token_id(token) for token in STOP_TOKENS]


# ---------------------------------------------------------------- the export


def test_the_export_holds_weights_configs_stop_ids_and_tokenizer(export, tokenizer, dataset):
    assert {p.name for p in export.iterdir()} == {
        SINGLE_FILE,
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((export / "config.json").read_text())
    assert set(config) == HUB_CONFIG_KEYS
    assert config["architectures"] == ["Glm4MoeForCausalLM"] and config["tie_word_embeddings"] is False
    stops = stop_ids(tokenizer)  # the tiny config names none: the tokenizer's <|endoftext|>, <|user|>, <|observation|>
    assert config["eos_token_id"] == stops and config["pad_token_id"] == tokenizer.token_id("<|endoftext|>")
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == stops and generation["pad_token_id"] == stops[0]
    assert (export / "tokenizer.json").read_bytes() == (dataset / "tokenizer.json").read_bytes()


def test_the_lm_head_and_the_mtp_layer_are_written_as_the_hub_stores_them(export, model):
    layers = model.config.num_hidden_layers
    with safe_open(export / SINGLE_FILE, framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("lm_head.weight"), model.lm_head.weight)  # untied: vLLM never ties
        mtp = {k.removeprefix(f"model.layers.{layers}.") for k in keys if k.startswith(f"model.layers.{layers}.")}
        own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
        assert own | {"self_attn.q_proj.weight", "mlp.gate.weight", "mlp.experts.7.down_proj.weight"} <= mtp
        # as GLM-4.6's checkpoints: no copies of the embedding and lm_head (GLM-4.5's); the engines share them
        assert not mtp & {"embed_tokens.weight", "shared_head.head.weight"}
        assert torch.equal(f.get_tensor(f"model.layers.{layers}.eh_proj.weight"), model.mtp_layers[0].eh_proj.weight)
    assert not any(k.startswith(f"model.layers.{layers + 1}.") for k in keys)
    reloaded = load_hf(export)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_transformers_reads_our_tokenizer_and_chat_template(export, tokenizer):
    hf = AutoTokenizer.from_pretrained(export)
    texts = ["def f(x):\n    return x * 2", "  Tabs\tand ünïcode, 123456 digits", "[gMASK]<sop><|user|>\nhi"]
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)
        assert hf.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert hf.eos_token == hf.pad_token == "<|endoftext|>" and hf.padding_side == "left"
    for messages in CONVERSATIONS:
        prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompt == tokenizer.encode(render_chat(messages, add_generation_prompt=True))
        assert prompt[-1] == tokenizer.token_id(ROLE_TOKENS["assistant"])
        assert hf.apply_chat_template(messages, tokenize=False) == render_chat(messages)
        full = [*messages, {"role": "assistant", "content": " 7"}]
        rendered = hf.apply_chat_template(full, tokenize=True, return_dict=False)
        assert rendered == format_chat(full, tokenizer)[0][:-1]  # format_chat ends the document with <|endoftext|>
    with pytest.raises(Exception, match="message 1: role observation is not one of"):
        hf.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "observation", "content": "b"}], tokenize=False
        )


def test_an_export_vllms_cpu_build_would_refuse_is_written_with_a_warning_naming_the_key(tmp_path, caplog):
    model = random_model(tiny_config(head_dim=16), seed=0)
    save_hf(model, tmp_path / "hf")
    assert (tmp_path / "hf" / SINGLE_FILE).is_file()  # still useful to transformers and GPU engines
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("head_dim=16: vLLM's CPU attention takes head_dim in [32, 64" in m for m in warned), warned


# ---------------------------------------------------------------- task=serve


def serve(compose_config, capsys, *overrides):
    result = run_task(compose_config("task=serve", "serve.dry=true", *overrides))
    return result["command"], capsys.readouterr().out.strip().splitlines()[-1]


def test_task_serve_prints_vllms_command_with_mtp_and_tensor_parallel(compose_config, capsys, export):
    run_dir = export.parent  # a run directory serves its hf/
    command, printed = serve(
        compose_config, capsys, f"serve.model={run_dir}", "serve.mtp=true", "serve.tensor_parallel_size=2"
    )
    assert command == [
        "vllm", "serve", str(export), "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "2",
        "--dtype", "auto", "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}',
        "--tool-parser-plugin", str(TOOL_PARSER_PLUGIN), "--tool-call-parser", "glm46", "--enable-auto-tool-choice",
        "--reasoning-parser", "glm45",
    ]  # fmt: skip
    assert printed.startswith(f"vllm serve {export} ") and printed.endswith(
        """--speculative-config '{"method":"mtp","num_speculative_tokens":1}' """
        f"--tool-parser-plugin {TOOL_PARSER_PLUGIN} --tool-call-parser glm46 --enable-auto-tool-choice "
        "--reasoning-parser glm45"
    )
    command, printed = serve(
        compose_config,
        capsys,
        f"serve.model={export}",
        "serve.python=/venv/bin/python",
        "+serve.env.VLLM_CPU_KVCACHE_SPACE=2",
        "serve.device=cpu",
        "serve.max_model_len=256",
        "serve.tool_call_parser=null",
        "serve.reasoning_parser=null",
    )
    assert command[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(export)]
    assert "--max-model-len" in command and "--speculative-config" not in command
    assert not {"--tool-parser-plugin", "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser"} & set(
        command
    )
    assert printed.startswith("VLLM_CPU_KVCACHE_SPACE=2 /venv/bin/python -m vllm.entrypoints.openai.api_server")


def test_task_serve_serves_a_peft_adapter_on_gpus_with_vllms_lora_flags_and_refuses_it_on_cpu(
    compose_config, capsys, export, tmp_path
):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 12}')
    command, _ = serve(compose_config, capsys, f"serve.model={export}", f"serve.lora={tmp_path}")
    at = command.index("--enable-lora")
    assert command[at : at + 5] == ["--enable-lora", "--lora-modules", f"adapter={tmp_path}", "--max-lora-rank", "16"]
    with pytest.raises(ConfigError, match="adapters are served by vLLM on GPUs"):
        serve(compose_config, capsys, f"serve.model={export}", f"serve.lora={tmp_path}", "serve.device=cpu")
    with pytest.raises(ConfigError, match="no adapter_config.json there"):
        serve(compose_config, capsys, f"serve.model={export}", f"serve.lora={tmp_path / 'none'}")


def test_task_serve_prints_sglangs_command_with_eagle_mtp(compose_config, capsys, export):
    command, _ = serve(
        compose_config,
        capsys,
        f"serve.model={export}",
        "serve.engine=sglang",
        "serve.mtp=true",
        "serve.speculative_steps=3",
        "serve.tensor_parallel_size=4",
    )
    assert command == [
        "python3", "-m", "sglang.launch_server", "--model-path", str(export), "--host", "127.0.0.1", "--port", "8000",
        "--tp-size", "4", "--dtype", "auto", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--tool-call-parser", "glm45",
        "--reasoning-parser", "glm45",
    ]  # fmt: skip


def test_the_355b_exports_production_launch_on_8_gpus(compose_config, capsys, tmp_path):
    config = model_config(compose_config("model=glm46_355b"))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config, torch.bfloat16)))  # the config is enough
    model = f"serve.model={tmp_path}"
    command, _ = serve(compose_config, capsys, model, "serve.tensor_parallel_size=8", "serve.mtp=true")
    assert command[:3] == ["vllm", "serve", str(tmp_path)]
    assert command[command.index("--tensor-parallel-size") + 1] == "8"
    assert command[command.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":1}'
    assert command[-7:] == [
        "--tool-parser-plugin", str(TOOL_PARSER_PLUGIN), "--tool-call-parser", "glm46", "--enable-auto-tool-choice",
        "--reasoning-parser", "glm45",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="serve.tensor_parallel_size=7 must divide num_attention_heads=96"):
        serve(compose_config, capsys, model, "serve.tensor_parallel_size=7")
    command, _ = serve(compose_config, capsys, model, "serve.tensor_parallel_size=16")  # 8 KV heads, each on 2 ranks
    assert command[command.index("--tensor-parallel-size") + 1] == "16"


@pytest.fixture(scope="module")
def export_without_mtp_and_head_dim_16(tmp_path_factory):
    model = random_model(tiny_config(head_dim=16, num_nextn_predict_layers=0), seed=0)
    return save_hf(model, tmp_path_factory.mktemp("odd") / "hf")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ((), "serve.model: no model to serve"),
        (("serve.model=/nonexistent",), "serve.model=/nonexistent: /nonexistent holds no model"),
        (("serve.model={export}", "serve.tensor_parallel_size=3"), "serve.tensor_parallel_size=3 must divide"),
        (("serve.model={export}", "serve.speculative_steps=0"), "serve.speculative_steps=0 must be >= 1"),
        (("serve.model={odd}", "serve.mtp=true"), "serve.mtp=true: the export has no MTP layer"),
        (("serve.model={odd}", "serve.device=cpu"), "head_dim=16: vLLM's CPU attention takes head_dim in"),
    ],
)
def test_task_serve_refuses_what_the_engine_cannot_serve_before_launching(
    compose_config, export, export_without_mtp_and_head_dim_16, overrides, message
):
    paths = {"export": export, "odd": export_without_mtp_and_head_dim_16}
    cfg = compose_config("task=serve", *(o.format(**paths) for o in overrides))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        run_task(cfg)


def test_task_serve_refuses_an_unknown_engine_at_composition(compose_config):
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("task=serve", "serve.engine=tgi")
    assert "Invalid value 'tgi', expected one of [vllm, sglang]" in str(error.value.__cause__)


def test_the_odd_export_serves_on_a_gpu(compose_config, capsys, export_without_mtp_and_head_dim_16):
    command, _ = serve(compose_config, capsys, f"serve.model={export_without_mtp_and_head_dim_16}")
    assert command[:3] == ["vllm", "serve", str(export_without_mtp_and_head_dim_16)]


# ---------------------------------------------------------------- vLLM (marker `serving`)


def require_serving() -> Path:
    return require_venv(serving_python(), "vLLM", "scripts/serving_venv.sh", "GLM46_REQUIRE_SERVING")


@pytest.fixture(scope="module")
def trained(dataset, tokenizer, trained_chat_model):
    """(model, its export, chat prompts of 6 lengths, our greedy completions cut after the first stop token)."""
    model, export = trained_chat_model
    rl = [json.loads(line)["text"] for line in (dataset / "documents" / "rl.jsonl").read_text().splitlines()]
    others = [tokenizer.encode(render_chat(CONVERSATIONS[2], add_generation_prompt=True))]
    others.append(tokenizer.encode("Once upon a time"))
    lengths = {len(prompt): None for prompt in others}  # the last rl prompts of 4 more lengths: padded differently
    for doc in reversed(rl):
        prompt = tokenizer.encode(doc[: doc.rindex(ROLE_TOKENS["assistant"]) + len(ROLE_TOKENS["assistant"])])
        lengths.setdefault(len(prompt), prompt)
    prompts = [prompt for prompt in lengths.values() if prompt is not None][:4] + others
    completions = [greedy(model, prompt, tokenizer) for prompt in prompts]
    return model, export, prompts, completions


def greedy(model: GLM46ForCausalLM, prompt: list[int], tokenizer: GLMTokenizer, max_new_tokens: int = 24) -> list[int]:
    stops = stop_ids(tokenizer)
    new = model.generate(torch.tensor([prompt]), max_new_tokens, eos_token_id=stops)[0, len(prompt) :].tolist()
    ends = [i for i, token in enumerate(new) if token in stops]
    return new[: ends[0] + 1] if ends else new


def mtp_drafts(model: GLM46ForCausalLM, ids: list[int]) -> torch.Tensor:
    """The MTP layer's greedy draft at each position i (of token i+2) as vLLM computes it: our MTP forward, with
    the input embedding at position 0 zeroed, as vLLM's glm4_moe_mtp.py does ("masking inputs at position 0, as
    not needed by MTP"; transformers and training do not). Through the MTP layer's attention that moves every
    later MTP logit a little: enough to flip a draft whose two best logits are 0.1 apart."""
    x, positions = torch.tensor([ids]), torch.arange(len(ids))[None]
    with torch.no_grad():
        hidden, _ = model.model(x, positions)
        embeds = model.model.embed_tokens(x.roll(-1, dims=1))  # token i+1 at position i
        embeds[:, 0] = 0
        cos, sin = model.model.rotary_emb(positions + 1, embeds.dtype)
        h, _ = model.mtp_layers[0](hidden, embeds, cos, sin)
        return model.lm_head(h)[0].argmax(-1)


def mtp_acceptance(model: GLM46ForCausalLM, prompt: list[int], completion: list[int]) -> list[int]:
    """Speculative decoding with one MTP draft per step, replayed on our model: 1/0 per verify step for a draft
    accepted/rejected. A draft of token j+1 comes from the MTP layer at the position before token j (its hidden
    state and token j's embedding); accepted, the step also yields token j+2 from the model, so the next draft
    is of token j+3."""
    drafts = mtp_drafts(model, prompt + completion)
    steps, j = [], 0
    while j + 1 < len(completion):
        steps.append(int(drafts[len(prompt) + j - 1].item() == completion[j + 1]))
        j += 2 if steps[-1] else 1
    return steps


@pytest.mark.serving
def test_vllm_decodes_the_export_greedily_as_generate_does(trained):
    python = require_serving()
    model, export, prompts, completions = trained
    assert len({len(p) for p in prompts}) == len(prompts) and any(len(c) == 24 for c in completions)
    result = vllm_generate(python, export, prompts, max_tokens=24)
    assert result["completions"] == completions


@pytest.mark.serving
def test_vllm_with_mtp_speculative_decoding_decodes_the_same_and_accepts_the_drafts_we_predict(trained):
    python = require_serving()
    model, export, prompts, completions = trained
    result = vllm_generate(python, export, prompts, max_tokens=24, speculative_tokens=1)
    assert result["completions"] == completions  # speculative decoding is lossless
    ours = [mtp_acceptance(model, p, c) for p, c in zip(prompts, completions)]
    theirs = [steps["accepted"] for steps in result["spec_decode"]]
    assert all(drafted == [1] * len(drafted) for drafted in (steps["drafted"] for steps in result["spec_decode"]))
    accepted = sum(map(sum, theirs)) / sum(map(len, theirs))
    print(f"MTP acceptance rate {accepted:.3f} over {sum(map(len, theirs))} drafts")
    assert theirs == ours  # vLLM's draft layer is our MTP layer, step for step
    assert accepted >= 0.4  # the trained MTP layer drafts well; a layer loaded wrong would be accepted at chance


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # the server's reason, not only its status
        raise AssertionError(f"{url} answered {error.code}: {error.read().decode(errors='replace')[:2000]}") from None


def assert_endpoint_scores_as_local(endpoint: str, export: str, dataset: Path, tmp_path: Path) -> None:
    """eval.endpoint against the running server (lm-eval's completions client, 2 requests in flight) gives the scores
    of the export evaluated here (greedy): the same replies (but the special tokens the server's text leaves out), the
    same exact match, and the held-out bits per byte from the echoed prompt log-probs within 1e-3."""
    from glm46.eval import evaluate

    from .test_eval import compose_run

    settings = [f"eval.dataset={dataset}", "eval.tasks=[glm46_arithmetic,glm46_ppl_sft]", "eval.limit=8"]
    settings += ["eval.max_gen_toks=24", "eval.max_length=512", "eval.ppl_documents=4", "eval.ppl_chars=400"]
    served = ["eval.endpoint=" + endpoint, f"eval.endpoint_model={export}", "eval.endpoint_concurrency=2"]
    remote = evaluate(compose_run(tmp_path / "remote", *settings, *served).eval, export, tmp_path / "remote")
    local = evaluate(compose_run(tmp_path / "local", *settings).eval, export, tmp_path / "local")
    from glm46.data.tokenizer import SPECIAL_TOKENS

    def text(reply: str) -> str:  # the server's completions drop special tokens (<think>) from the text
        for token in SPECIAL_TOKENS:
            reply = reply.replace(token, "")
        return reply

    answers = [[text(s["filtered_resps"][0]) for s in r["samples"]["glm46_arithmetic"]] for r in (remote, local)]
    assert answers[0] == answers[1]
    for task, metric in (("glm46_arithmetic", "exact_match,none"), ("glm46_ppl_sft", "bits_per_byte,none")):
        assert remote["results"][task][metric] == pytest.approx(local["results"][task][metric], rel=1e-3), task


@pytest.mark.serving
def test_task_serve_runs_vllms_openai_server_that_chats_with_our_template(trained, tokenizer, dataset, tmp_path):
    python = require_serving()
    model, export, _, _ = trained
    port = free_port()
    overrides = [
        f"serve.model={export}",
        f"serve.python={python}",
        "serve.device=cpu",
        "serve.mtp=true",
        f"serve.port={port}",
        "serve.max_model_len=1024",
        "serve.dtype=float32",  # as ours: vLLM's auto runs an fp32 export in bf16, which flips near-tied argmaxes
        "+serve.env.VLLM_CPU_KVCACHE_SPACE=1",
        "serve.extra_args=[--enforce-eager]",  # no torch.compile warm-up: about 60 s of the start on 2 cores
        f"hydra.run.dir={tmp_path}",
    ]
    command = [sys.executable, str(ROOT / "run.py"), "task=serve", *overrides]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (
                f"task=serve exited with {server.returncode}:\n" + (tmp_path / "serve.log").read_text()[-3000:]
            )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, (
                    "vLLM's server did not answer within 300 s:\n" + (tmp_path / "serve.log").read_text()[-3000:]
                )
                time.sleep(2)
        messages = CONVERSATIONS[0]
        reply = post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": str(export), "messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        )
        choice = reply["choices"][0]
        prompt = tokenizer.encode(render_chat(messages, add_generation_prompt=True))
        ours = greedy(model, prompt, tokenizer)
        assert reply["prompt_token_ids"] == prompt  # the chat template in tokenizer_config.json is ours
        assert choice["token_ids"] == ours
        assert "<think>" not in (choice["message"]["content"] or "")  # the reasoning parser took the think block
        # tools with tool_choice auto (GLM's tool-call parser), then a conversation holding an assistant's call (in
        # OpenAI's form: arguments as a JSON string) and its result: both answered, rendered as GLM-4.6 renders them,
        # and decoded as the model decodes them alone: the parser (serve.tool_call_parser=glm46) lays no grammar of
        # another call layout over them (vLLM's own glm45 forces GLM-4.7's, and this model's call goes astray)
        tools, stops = [CALCULATOR], stop_ids(tokenizer)
        for messages in ([{"role": "user", "content": "What is 1234 * 56?"}], TOOL_TURNS):
            body = {"model": str(export), "messages": messages, "tools": tools, "tool_choice": "auto"}
            body |= {"max_tokens": 32, "temperature": 0, "return_token_ids": True}
            reply = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            prompt = tokenizer.encode(render_chat(messages, tools, add_generation_prompt=True))
            ours = greedy(model, prompt, tokenizer, max_new_tokens=32)
            assert reply["prompt_token_ids"] == prompt
            choice = reply["choices"][0]
            assert choice["token_ids"] == ours, tokenizer.decode(choice["token_ids"])
            calls = [
                {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                for call in choice["message"].get("tool_calls") or []
            ]
            try:
                expected = parse_tool_calls(tokenizer.decode(ours), tools)
            except ValueError:  # an unclosed call: the reply's content, as vLLM's parser leaves it
                expected = []
            assert calls == expected
            assert choice["finish_reason"] == ("tool_calls" if calls else "stop" if ours[-1] in stops else "length")
        assert_endpoint_scores_as_local(f"http://127.0.0.1:{port}/v1", str(export), dataset, tmp_path)
        server.terminate()  # task=serve passes SIGTERM on: vLLM's server and engine stop with it
        server.wait(timeout=120)
        deadline = time.monotonic() + 30  # vLLM's engine core and workers shut down after its server
        while engine_processes(server.pid) and time.monotonic() < deadline:
            time.sleep(1)
        assert not engine_processes(server.pid), "vLLM outlived task=serve"
    finally:
        if server.poll() is None or engine_processes(server.pid):
            os.killpg(server.pid, signal.SIGKILL)


def engine_processes(session: int) -> list[int]:
    """Processes still alive in the session that task=serve started (vLLM's server, engine core, workers)."""
    listing = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout.split("\n")
    return [
        int(p)
        for p, sid, stat in (line.split() for line in listing if line.strip())
        if int(sid) == session and "Z" not in stat
    ]
